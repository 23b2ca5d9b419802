"""Keeping a fastai optimizer on the model's parameters when ``wrap_model`` moves the model.

fastai creates the optimizer (``learn.create_opt``) before ``before_fit``, from the parameters
the model has then. ``module.to(device)`` keeps each ``Parameter`` object only when the new
tensor type can share the old one's implementation (CPU and CUDA can); a move to an XLA device
makes *new* ``Parameter`` objects, so an optimizer built before it would step the stale CPU
copies while the model trains on the device (fastai's own ``TrainEvalCallback`` moves the model
to ``dls.device`` after creating the optimizer too, which is why fastai on XLA needs this).

:class:`Placement` records where each parameter lives before the wrap; :meth:`Placement.moved`
rebinds the optimizer to the new parameters (its per-parameter state moved along), and
:meth:`Placement.restore` puts the original ``Parameter`` objects back after the fit, holding the
trained values, on their original device, with the optimizer rebound to them: after ``fit`` the
``Learner`` is as fastai made it (model and optimizer on ``dls.device``), whatever the runtime.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

__all__ = ["Placement", "rebind_optimizer"]


class Placement:
    """Where every parameter of ``module`` is before ``wrap_model`` (see the module docstring)."""

    def __init__(self, module: nn.Module):
        self.module = module
        # (owning module, attribute name, the Parameter object): what restore() puts back.
        self.slots = [(owner, key, p) for owner in module.modules() for key, p in owner._parameters.items()
                      if p is not None]
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else None
        self.replaced = False

    def moved(self, opt: Any) -> bool:
        """After the wrap: rebind ``opt`` (``None``: none yet) to the parameters that replaced the
        recorded ones; whether any was replaced."""
        mapping: dict[int, nn.Parameter] = {}
        for owner, key, p in self.slots:
            current = owner._parameters[key]
            if current is not None and current is not p:
                mapping[id(p)] = current
        self.replaced = bool(mapping)
        if mapping and opt is not None:
            rebind_optimizer(opt, mapping)
        return self.replaced

    def restore(self, opt: Any) -> None:
        """After the fit: the recorded ``Parameter`` objects back in the module with the trained
        values, the module's buffers back on the recorded device, ``opt`` rebound to them."""
        if not self.replaced:
            return
        mapping: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for owner, key, original in self.slots:
                current = owner._parameters[key]
                if current is None or current is original:
                    continue
                original.copy_(current.detach().to(original.device))
                owner._parameters[key] = original
                mapping[id(current)] = original
        if self.device is not None:
            self.module.to(self.device)  # buffers; the parameters are there already and kept
        if mapping and opt is not None:
            rebind_optimizer(opt, mapping)
        self.replaced = False


def _moved_state(state: Any, to: torch.Tensor) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(to.device)
    if isinstance(state, dict):
        return {k: _moved_state(v, to) for k, v in state.items()}
    return state


def rebind_optimizer(opt: Any, mapping: dict[int, nn.Parameter]) -> None:
    """Replace, in ``opt``, every parameter ``p`` with ``id(p)`` in ``mapping`` by
    ``mapping[id(p)]``, its per-parameter state moved to that parameter's device. ``opt`` is a
    fastai ``Optimizer`` (``param_lists``, ``state``) or an ``OptimWrapper`` of a torch optimizer."""
    def swap(p: Any) -> Any:
        return mapping.get(id(p), p)

    inner = getattr(opt, "opt", None)
    if isinstance(inner, torch.optim.Optimizer):  # fastai's OptimWrapper around a torch optimizer
        for group in inner.param_groups:
            group["params"] = [swap(p) for p in group["params"]]
        state: Any = defaultdict(dict)
        for p, s in inner.state.items():
            state[swap(p)] = _moved_state(s, swap(p))
        inner.state = state
        return
    if hasattr(opt, "param_lists") and hasattr(opt, "state"):  # fastai's Optimizer
        from fastcore.foundation import L

        opt.param_lists = L(L(swap(p) for p in group) for group in opt.param_lists)
        fastai_state: Any = defaultdict(dict)
        for p, s in opt.state.items():
            fastai_state[swap(p)] = _moved_state(s, swap(p))
        opt.state = fastai_state
        return
    raise TypeError(f"the fastai adapter cannot follow the model's parameters to their new device in an optimizer "
                    f"of type {type(opt).__name__}: it knows fastai's Optimizer and OptimWrapper. Put the model on "
                    "the runtime's device before creating the Learner, or use a fastai opt_func.")
