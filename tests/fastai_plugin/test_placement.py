"""``polyparallel_fastai/placement.py``: the optimizer follows parameters that a device move
replaced (as ``module.to(xla_device)`` does), and the user's parameter objects come back with
the trained values. The move is made here by replacing each ``Parameter`` with a new object,
which is what ``Module._apply`` does for an XLA device (tests/xla_plugin/test_fastai.py runs the
real one)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from polyparallel_fastai.placement import Placement, rebind_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _replace_parameters(model: nn.Module) -> None:
    for owner in model.modules():
        for key, p in list(owner._parameters.items()):
            if p is not None:
                owner._parameters[key] = nn.Parameter(p.detach().clone())


def _step(model: nn.Module, opt: Any) -> None:
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    opt.zero_grad()


def _fastai_sgd(model: nn.Module) -> Any:
    from fastai.optimizer import SGD

    return SGD(list(model.parameters()), lr=0.1, mom=0.9)


def _wrapped_torch_sgd(model: nn.Module) -> Any:
    from fastai.optimizer import OptimWrapper

    return OptimWrapper(list(model.parameters()), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))


def _opt_params(opt: Any) -> list[Any]:
    inner = getattr(opt, "opt", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [p for g in inner.param_groups for p in g["params"]]
    return [p for p, *_ in opt.all_params()]


@pytest.mark.parametrize("make_opt", [_fastai_sgd, _wrapped_torch_sgd], ids=["fastai-Optimizer", "OptimWrapper"])
def test_optimizer_follows_the_move_and_back(make_opt: Any) -> None:
    model = _model()
    opt = make_opt(model)
    _step(model, opt)  # momentum state exists before the move
    originals = list(model.parameters())
    placement = Placement(model)
    _replace_parameters(model)
    assert placement.moved(opt)
    moved = list(model.parameters())
    assert all(a is b for a, b in zip(_opt_params(opt), moved))
    _step(model, opt)  # the optimizer steps the parameters the model uses
    trained = [p.detach().clone() for p in moved]
    assert not all(torch.equal(a, b) for a, b in zip(trained, originals))

    placement.restore(opt)
    assert all(a is b for a, b in zip(model.parameters(), originals))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained))
    assert all(a is b for a, b in zip(_opt_params(opt), originals))
    _step(model, opt)  # momentum kept across both rebinds: same as stepping a never-moved copy
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), trained))


def test_momentum_state_survives_the_rebind() -> None:
    plain, moved_model = _model(), _model()
    opts = [_fastai_sgd(plain), _fastai_sgd(moved_model)]
    torch.manual_seed(1)
    batches = [torch.randn(5, 3) for _ in range(3)]
    for model, opt in zip((plain, moved_model), opts):
        model(batches[0]).sum().backward()
        opt.step()
        opt.zero_grad()
    placement = Placement(moved_model)
    _replace_parameters(moved_model)
    placement.moved(opts[1])
    for model, opt in zip((plain, moved_model), opts):
        for x in batches[1:]:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    placement.restore(opts[1])
    for a, b in zip(plain.parameters(), moved_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nothing_replaced_leaves_the_optimizer_alone() -> None:
    model = _model()
    opt = _fastai_sgd(model)
    placement = Placement(model)
    assert not placement.moved(opt)
    placement.restore(opt)
    assert all(a is b for a, b in zip(_opt_params(opt), model.parameters()))


def test_unknown_optimizer_type_refused_with_the_way_out() -> None:
    model = _model()
    with pytest.raises(TypeError, match="fastai's Optimizer and OptimWrapper.*opt_func"):
        rebind_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {id(next(model.parameters())): nn.Parameter(torch.ones(1))})
