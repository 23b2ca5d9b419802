"""The Model's compiled steps under Strategy(accumulate=N): the global batch is micro x N x data,
the gradient is reduced over data once per optimizer step (counted in the compiled HLO), and
runs at different data sizes and accumulations equal one device on the same global batch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from polyparallel_jax import Model
from polyparallel_jax.conformance import dataset, small_mlp

from ._runs import fit, fit_in_process, max_diff


@pytest.mark.parametrize(("samples", "optimizer"), [
    (200, ("adam", 1e-2)), pytest.param(192, ("adam", 1e-2), marks=pytest.mark.slow),
    pytest.param(200, ("sgd", 0.1), marks=pytest.mark.slow), pytest.param(192, ("sgd", 0.1), marks=pytest.mark.slow),
], ids=["partial-last-step-adam", "steps-divide-adam", "partial-last-step-sgd", "steps-divide-sgd"])
def test_accumulation_equals_one_device_on_the_same_global_batch(samples, optimizer):
    # 32 a step: data=2 x accumulate=2 (x tensor=4, the default Megatron plan) is 8-row
    # micro-batches, data=4 x accumulate=1 (x tensor=2) 8-row batches, data=8 x accumulate=4
    # 1-row micro-batches; 200 samples end each epoch with a partial step of 8 (padded micro-batches).
    one = fit(None, samples=samples, optimizer=optimizer)
    for strategy in (dict(data=2, tensor=4, accumulate=2), dict(data=4, tensor=2), dict(data=8, accumulate=4)):
        run = fit(strategy, samples=samples, optimizer=optimizer)
        assert max_diff(one["params"], run["params"]) <= 1e-5, strategy
        np.testing.assert_allclose(run["history"]["loss"], one["history"]["loss"], atol=1e-5)
        np.testing.assert_allclose(run["history"]["accuracy"], one["history"]["accuracy"], atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_data2_accumulate2_equals_data4_and_one_device_in_processes_of_their_own():
    # Without tensor replicas: a process of 2 devices at data=2 x accumulate=2, one of 4 at data=4.
    one = fit(None, samples=200, optimizer=("adam", 1e-2))
    two = fit_in_process(2, dict(data=2, accumulate=2), samples=200, optimizer=("adam", 1e-2))
    four = fit_in_process(4, dict(data=4), samples=200, optimizer=("adam", 1e-2))
    assert max_diff(one["params"], two["params"]) <= 1e-5 and max_diff(one["params"], four["params"]) <= 1e-5
    np.testing.assert_allclose(two["history"]["loss"], four["history"]["loss"], atol=1e-5)


def test_batch_norm_micro_batches_are_the_same_rows_at_every_data_size():
    # Synchronised BatchNorm normalises each micro-batch over its global rows: micro-batch k of a
    # step is the same 16 rows at data=8 x accumulate=2 and data=4 x tensor=2 x accumulate=2, so
    # statistics, parameters and history agree; whole 32-row batches (no accumulation) differ.
    # (192 samples: no partial step, whose padding rows BatchNorm's statistics would see.)
    runs = [fit(dict(data=8, accumulate=2), samples=192, batch_norm=True),
            fit(dict(data=4, tensor=2, accumulate=2), samples=192, batch_norm=True)]
    assert max_diff(runs[0]["params"], runs[1]["params"]) <= 1e-5
    assert max_diff(runs[0]["stats"], runs[1]["stats"]) <= 1e-5
    np.testing.assert_allclose(runs[0]["history"]["loss"], runs[1]["history"]["loss"], atol=1e-5)
    assert max_diff(runs[0]["params"], fit(None, samples=192, batch_norm=True)["params"]) > 1e-3


# -- one reduction per optimizer step: the compiled program --------------------------------------


def _computations(hlo: str) -> dict[str, list[str]]:
    """Compiled HLO text -> computation name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            out[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            out[name].append(line)
    return out


def _called(lines: list[str]) -> set[str]:
    return {m for line in lines for m in re.findall(
        r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", line)}


def _all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduce instructions outside every loop, inside a loop body or what it calls)."""
    computations = _computations(hlo)
    loops = {m for lines in computations.values() for line in lines if " while(" in line
             for m in re.findall(r"body=%?([\w.\-]+)", line)}
    inside, todo = set(), list(loops)
    while todo:
        name = todo.pop()
        if name not in inside and name in computations:
            inside.add(name)
            todo.extend(_called(computations[name]))
    count = {True: 0, False: 0}
    for name, lines in computations.items():
        count[name in inside] += sum(1 for line in lines if re.search(r"= .*\ball-reduce(-start)?\(", line))
    return count[False], count[True]


def _train_hlo(strategy, samples=64, batch_size=32):
    x, y = dataset(samples)
    model = Model(small_mlp(batch_norm=False), optimizer=optax.sgd(0.1))
    model.fit(x, y, batch_size=batch_size, strategy=strategy, verbose=0)
    step = model._step(train=True)
    _, params, stats, rest = model._split(train=True)
    batch = next(iter(model._data((x, y), batch_size, False, "pad", None).batches(0)))
    return step.lower(params, stats, rest, model._opt_state, *batch.data, batch.mask).compile().as_text()


def test_the_gradients_are_reduced_once_per_step_not_per_micro_batch(jax_strategy):
    # data=8 only: every all-reduce in the program is over data. Accumulating 4 micro-batches
    # runs them in a loop with no all-reduce inside, and the program has as many all-reduces as
    # without accumulation (the gradients, combined; the row count; the metrics).
    plain_outside, plain_inside = _all_reduces(_train_hlo(jax_strategy(data=8)))
    outside, inside = _all_reduces(_train_hlo(jax_strategy(data=8, accumulate=4)))
    assert plain_inside == 0 and inside == 0
    assert outside == plain_outside >= 1


def test_the_hlo_count_sees_a_reduction_per_micro_batch():
    # The control for the test above: a scan that reduces each micro-batch's gradient is found.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_micro(w, x):
        def body(acc, xb):
            g = jax.grad(lambda v: jnp.sum(xb @ v))(jax.lax.pcast(w, "data", to="varying"))
            return acc + jax.lax.pmean(g, "data"), None
        return jax.lax.scan(body, jnp.zeros_like(w), x)[0]

    f = jax.jit(jax.shard_map(per_micro, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P()))
    hlo = f.lower(jnp.ones((4, 2)), jnp.ones((3, 16, 4))).compile().as_text()
    assert _all_reduces(hlo)[1] >= 1


# -- bad input ------------------------------------------------------------------------------------


def test_a_global_batch_that_does_not_divide_into_micro_batches_is_refused(jax_strategy):
    x, y = dataset(64)
    model = Model(small_mlp())
    with pytest.raises(ValueError, match=r"global batch size 24 does not divide over data=4 ranks x accumulate=4 "
                                         r"micro-batches.*multiple of 16 \(16 or 32\)"):
        model.fit(x, y, batch_size=24, strategy=jax_strategy(data=4, tensor=2, accumulate=4), verbose=0)
    assert model._steps == {}


def test_evaluation_under_an_accumulating_strategy_takes_whole_batches(jax_strategy):
    # Nothing to accumulate without a backward pass: evaluate's batch need only divide over data
    # (24 over data=4, not over 4 x accumulate=4), and counts every one of 203 samples once.
    x, y = dataset(203)
    single = Model(small_mlp(batch_norm=False))
    model = Model(small_mlp(batch_norm=False))
    expected = single.evaluate(x, y, batch_size=24)
    assert model.evaluate(x, y, batch_size=24, strategy=jax_strategy(data=4, tensor=2, accumulate=4)) == pytest.approx(
        expected, abs=1e-6)


def test_micro_batches_of_padding_only_are_skipped():
    # 200 samples end each epoch with a step of 8 rows, at accumulate=4 (8-row micro-batches)
    # all of them in micro-batch 0, at data=8 and at data=4 alike; micro-batches 1-3 are padding
    # only. Were they run, BatchNorm's statistics would take in their padding rows (different
    # rows at each data size) and the two runs would differ.
    runs = [fit(dict(data=8, accumulate=4), batch_norm=True), fit(dict(data=4, tensor=2, accumulate=4), batch_norm=True)]
    assert max_diff(runs[0]["stats"], runs[1]["stats"]) <= 1e-5
    assert max_diff(runs[0]["params"], runs[1]["params"]) <= 1e-5
    np.testing.assert_allclose(runs[0]["history"]["loss"], runs[1]["history"]["loss"], atol=1e-5)
