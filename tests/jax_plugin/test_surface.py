"""polyparallel_jax.surface: the JAX Model's everyday surface, classified and proven.

(a) the classification covers every public method, argument and attribute of ``Model`` and of
the callbacks; (b) every "works" entry's scenario runs at data=2 (a process of 2 devices) and at
data=4 x tensor=2 as on one device with the same global batch, evaluating on 203 rows; (c) every
"refused" entry is refused before anything is placed, compiled or trained, with its reason and
what to do instead; ``docs/surface/jax.md`` is what the classification generates.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from polyparallel_jax import Model, callbacks, surface
from polyparallel_jax.conformance import dataset, small_mlp

from . import _scenarios
from ._runs import TESTS

ROOT = Path(__file__).parents[2]
WORKS = sorted({entry.test for entry in surface.ENTRIES if entry.status == "works"})
REFUSED = [entry for entry in surface.ENTRIES if entry.status == "refused"]


# -- (a) the classification covers the surface ---------------------------------------------------


def _public_surface() -> set[str]:
    names = {f"Model({p}=)" for p in list(inspect.signature(Model.__init__).parameters)[1:]}
    instance = Model(small_mlp())
    for name in {*dir(Model), *vars(instance)}:
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(Model, name, None)
        if not callable(member) or isinstance(member, property):
            names.add(name)
            continue
        names.add(name)
        for p in list(inspect.signature(member).parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD and p.name != "unsupported":
                names.add(f"{name}(**{p.name})")
            elif p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                names.add(f"{name}({p.name}=)")
    return names


def test_every_public_method_argument_and_attribute_is_classified():
    classified = {entry.name for entry in surface.ENTRIES}
    missing = _public_surface() - classified
    assert not missing, f"Model's public surface has entries polyparallel_jax.surface does not classify: {sorted(missing)}"
    public = _public_surface()
    for entry in surface.ENTRIES:
        if entry.kind in ("method", "argument", "attribute") and entry.status == "works":
            assert entry.name in public, f"{entry.name} is classified as working but is not part of Model"
        if entry.kind == "argument" and entry.status == "refused":
            assert entry.name not in public, f"{entry.name} is refused but is an argument of Model"


def test_every_callback_argument_is_classified():
    named = " ".join(entry.name for entry in surface.ENTRIES if entry.kind == "callback")
    for cls in (callbacks.EarlyStopping, callbacks.ModelCheckpoint):
        for p in list(inspect.signature(cls.__init__).parameters)[1:]:
            assert f"{p}=" in named and cls.__name__ in named, f"{cls.__name__}({p}=) is not classified"
    for method in ("set_model", "on_train_begin", "on_epoch_end", "on_train_end"):
        assert method in named


def test_every_works_entry_names_a_scenario_and_every_scenario_proves_one():
    assert set(WORKS) == set(_scenarios.SCENARIOS)
    for entry in REFUSED:
        assert entry.reason and entry.instead and not entry.test


# -- (b) works: data=2 and data=4 x tensor=2 as one device ----------------------------------------


def _assert_same(a, b, where=""):
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)) and not (a and isinstance(a[0], float)):
        assert len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, (float, np.ndarray, list)) and not isinstance(a, bool):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5, err_msg=where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    return {name: _scenarios.run(name, None, str(tmp / name)) for name in WORKS}


@pytest.fixture(scope="module")
def at_data2(tmp_path_factory):
    # Every scenario in one process of 2 CPU devices at data=2 (no tensor replicas).
    import os

    from polyparallel_jax.launch import launch_processes

    tmp = tmp_path_factory.mktemp("data2")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *filter(None, [saved])])
    try:
        return launch_processes(_scenarios.run_all, 1, args=(WORKS, {"data": 2}, str(tmp)), devices_per_process=2,
                                timeout=600)[0]
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", WORKS)
def test_works_at_data2_as_on_one_device(scenario, one_device, at_data2):
    _assert_same(at_data2[scenario], one_device[scenario], scenario)


@pytest.mark.slow  # about 80 s for all scenarios; data=2 above runs by default
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", WORKS)
def test_works_at_data4_tensor2_as_on_one_device(scenario, one_device, tmp_path):
    _assert_same(_scenarios.run(scenario, {"data": 4, "tensor": 2}, str(tmp_path)), one_device[scenario], scenario)


# -- (c) refused before anything runs ---------------------------------------------------------------


def _call(model, name):
    x, y = dataset(64)
    if name == "compile":
        return model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    if name == "fit(x=<iterator or dataset>)":
        return model.fit(iter(x), y, batch_size=16)
    method, argument = name[:-2].split("(")
    args = (x, y) if method in ("fit", "evaluate") else (x,)
    return getattr(model, method)(*args, **{argument: 1})


@pytest.mark.parametrize("entry", REFUSED, ids=[entry.name for entry in REFUSED])
def test_refused_before_anything_runs_saying_why_and_what_instead(entry, jax_strategy):
    model = Model(small_mlp(), strategy=jax_strategy(data=8))
    with pytest.raises(TypeError) as caught:
        _call(model, entry.name)
    message = str(caught.value)
    assert entry.reason in message and entry.instead in message
    assert model.placed_strategy is None and model._steps == {} and model.history == {}


def test_unknown_arguments_are_named():
    with pytest.raises(TypeError, match=r"Model.fit\(\) got unexpected keyword argument\(s\) 'epoch'"):
        Model(small_mlp()).fit(*dataset(64), epoch=3)


# -- the published table --------------------------------------------------------------------------------


def test_the_committed_table_is_the_generated_one():
    committed = (ROOT / "docs" / "surface" / "jax.md").read_text()
    assert committed == surface.markdown(), "regenerate: python -m polyparallel_jax.surface > docs/surface/jax.md"
    works = sum(entry.status == "works" for entry in surface.ENTRIES)
    assert f"works: {works}, refused: {len(REFUSED)}, total: {len(surface.ENTRIES)}" in committed
