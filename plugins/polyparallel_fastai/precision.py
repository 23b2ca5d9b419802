"""``Strategy(precision=)`` on fastai: its ``MixedPrecision`` callback, on the runtime's device.

fastai's ``MixedPrecision`` (``learn.to_bf16()``, ``learn.to_fp16()``) autocasts with
``autocast("cuda")`` and a CUDA ``GradScaler``: on the CPU it computes in float32 and says
nothing. When the Strategy sets a precision, the adapter (:func:`apply`, from the callback's
``before_fit``, before any collective) makes the Learner's ``MixedPrecision`` follow it on the
device the model is on:

=================  ========================================================================
Strategy           fastai
=================  ========================================================================
``"32"``           no ``MixedPrecision`` (one the Learner carries is refused, naming both)
``"bf16-mixed"``   ``MixedPrecision(amp_mode="bf16")`` (``to_bf16``): bfloat16 autocast on the
                   model's device (CPU, CUDA, XLA), float32 parameters, optimizer state and
                   the gradient reduction
``"fp16-mixed"``   ``MixedPrecision(amp_mode="fp16")`` (``to_fp16``) with its ``GradScaler`` on
                   the model's device (the CPU has float16 autocast and a GradScaler in torch
                   >= 2.3), dynamic loss scaling as fastai does it (a step with inf/NaN
                   gradients is skipped on every rank alike: the gradients were all-reduced)
=================  ========================================================================

The Learner's own ``MixedPrecision`` is used when it carries one of the same mode (its
``GradScaler`` options kept); otherwise one is added for the fit and removed at its end (the
Learner is left as it was). One of the other mode is refused, naming both. ``"bf16-true"`` is
refused before launch: fastai's only "true" half precision is ``ModelToHalf`` (float16, inputs
cast by hand), and dtype combinations other than the presets have no fastai mechanism.
``Strategy(precision=None)`` leaves the Learner's callbacks as they are.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from fastai.callback.fp16 import AMPMode, MixedPrecision
from fastai.torch_core import L
from torch.amp import GradScaler, autocast

import polyparallel as pp

__all__ = ["AMP_MODES", "apply", "StrategyMixedPrecision"]

#: The Strategy's mixed presets and fastai's ``amp_mode`` for them.
AMP_MODES = {"bf16-mixed": AMPMode.BF16, "fp16-mixed": AMPMode.FP16}
_SPELLING = {AMPMode.BF16: "learn.to_bf16() / MixedPrecision(amp_mode='bf16')",
             AMPMode.FP16: "learn.to_fp16() / MixedPrecision(amp_mode='fp16')"}


def _device_type(learn: Any) -> str:
    param = next(iter(learn.model.parameters()), None)
    return param.device.type if param is not None else "cpu"


def device_before_fit(self: Any) -> None:
    """``MixedPrecision.before_fit`` with the model's device type instead of ``"cuda"``."""
    dtype = torch.bfloat16 if self.amp_mode == AMPMode.BF16 else torch.float16
    device = _device_type(self.learn)
    self.kwargs["enabled"] = dtype == torch.float16  # no scaling for bfloat16 (float32's exponent range)
    self.autocast, self.learn.scaler, self.scales = autocast(device, dtype=dtype), GradScaler(device, **self.kwargs), L()


class StrategyMixedPrecision(MixedPrecision):
    """The ``MixedPrecision`` the adapter adds for one fit when the Learner carries none: fastai's,
    on the model's device, removed from the Learner once its ``after_fit`` has run."""

    def before_fit(self) -> None:
        device_before_fit(self)

    def after_fit(self) -> None:
        super().after_fit()
        self.learn.remove_cb(self)


def apply(learn: Any, strategy: pp.Strategy) -> None:
    """Make ``learn``'s mixed precision the Strategy's (see the module docstring). Called from the
    adapter's ``before_fit`` after the model is wrapped, before fastai's ``MixedPrecision``
    (order 10) runs its own ``before_fit``."""
    policy = strategy.precision
    if policy is None:
        return
    carried = [cb for cb in learn.cbs if isinstance(cb, MixedPrecision)]
    wanted = AMP_MODES.get(policy.name or "")
    if policy.name not in ("32", *AMP_MODES):
        raise pp.UnsupportedTopologyError(f"the fastai adapter cannot run precision {policy!r}: it maps '32', "
                                          "'bf16-mixed' and 'fp16-mixed' to fastai's MixedPrecision.")
    for cb in carried:
        if cb.amp_mode != wanted:
            raise pp.TopologyError(
                f"the Learner's {_SPELLING[cb.amp_mode]} contradicts Strategy(precision={policy.name!r})"
                + (f", which is fastai's {_SPELLING[wanted]}" if wanted is not None else ", which is float32")
                + ". The precision belongs to the polyparallel Strategy: leave the callback out (the adapter adds "
                "it), or change Strategy(precision=).")
        if isinstance(cb, StrategyMixedPrecision):
            continue
        if type(cb).before_fit is not MixedPrecision.before_fit:
            raise TypeError(f"the fastai adapter runs MixedPrecision on the model's device; {type(cb).__name__} "
                            "replaces its before_fit. Use MixedPrecision itself (learn.to_bf16()/to_fp16()).")
    if wanted is None:
        return
    device = _device_type(learn)
    # XLA devices: bfloat16 autocast on "xla" (no scaler: the XLA runtime makes none; fp16-mixed is
    # refused before launch by its capabilities).
    if device not in ("cpu", "cuda") and not (device == "xla" and wanted == AMPMode.BF16):
        raise pp.UnsupportedTopologyError(
            f"the fastai adapter maps Strategy(precision={policy.name!r}) to autocast on CPU and CUDA (bf16-mixed also "
            f"on XLA devices); the model is on {device!r}, where it is not mapped. Use precision=None there (the "
            "runtime's own dtypes).")
    if carried:
        for cb in carried:  # its own before_fit (order 10, still to come in this event) made device-true
            cb.__dict__["before_fit"] = types.MethodType(device_before_fit, cb)
            cb.__dict__["after_fit"] = _restoring_after_fit(cb)
        return
    added = StrategyMixedPrecision(amp_mode=wanted)
    learn.add_cb(added)
    added.before_fit()  # added during before_fit: fastai will not call it for this event


def _restoring_after_fit(cb: Any) -> Any:
    """The Learner's own ``MixedPrecision`` gets its methods back once its ``after_fit`` ran."""

    def after_fit() -> None:
        MixedPrecision.after_fit(cb)
        cb.__dict__.pop("before_fit", None)
        cb.__dict__.pop("after_fit", None)

    return after_fit
