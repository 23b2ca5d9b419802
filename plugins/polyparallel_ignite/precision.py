"""``Strategy(precision=)`` and ``Strategy(accumulate=)`` on Ignite: its supervised step, made
device-true.

Ignite's own ``create_supervised_trainer(amp_mode="amp", scaler=...)`` autocasts on CUDA only
(``autocast("cuda")``: on the CPU it computes in float32 and says nothing). When the Strategy
sets a precision or accumulates, :meth:`IgniteAdapter.create_supervised_trainer
<polyparallel_ignite.IgniteAdapter.create_supervised_trainer>` builds the same step as ignite's
``supervised_training_step_amp`` (same arguments: ``prepare_batch``, ``model_transform``,
``output_transform``, ``model_fn``, ``non_blocking``; same order of zero_grad, forward, scaled
backward, step) with the Strategy's settings (:func:`training_step`):

=======================  ===================================================================
Strategy                 the step
=======================  ===================================================================
``compute_dtype``        ``torch.autocast(<the runtime's device type>, dtype=compute_dtype)``
                         around the forward and the loss (mixed precision only)
``param_dtype``          the model's floating parameters cast to it by ``auto_model``, before
                         the model is wrapped, and floating inputs cast to it in the step
                         (``"bf16-true"``)
``reduce_dtype``         DDP reduces in the parameters' dtype, which every preset names
``loss_scaling``         ``torch.amp.GradScaler(<device type>)`` (``"fp16-mixed"``; the CPU has
                         float16 autocast and a GradScaler in torch >= 2.3), in
                         ``engine.state.scaler``
``accumulate=N``         ignite's ``gradient_accumulation_steps=N`` (loss divided by N, one
                         optimizer step per N iterations) over ``auto_dataloader``'s
                         micro-batches; the first N-1 backward passes run in the runtime's
                         ``no_sync`` (DDP, FSDP2): one gradient reduction per step
=======================  ===================================================================

The evaluator (``create_supervised_evaluator``) autocasts its forward in the compute dtype as well.

Refused when the trainer is built, naming both: ``amp_mode=`` (ignite's CUDA autocast, or apex)
together with a Strategy precision, a ``scaler=`` that contradicts the Strategy's loss scaling,
and ``gradient_accumulation_steps=`` other than ``Strategy(accumulate=)``; a precision or an
accumulation for a pipeline model (its GPipe step is the runtime's). Refused before launch
(capabilities): dtype combinations other than the presets (``"custom"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.precision import cast_floating

__all__ = ["check_kwargs", "training_step", "autocast", "cast_params"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(policy: pp.PrecisionPolicy | None, device: torch.device) -> Any:
    """The forward's autocast context for ``policy`` (a null context when it is not mixed)."""
    if policy is None or not policy.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[policy.compute_dtype])


def cast_params(model: nn.Module, policy: pp.PrecisionPolicy | None) -> nn.Module:
    """``model`` with its floating parameters and buffers in ``policy.param_dtype`` (in place)."""
    if policy is not None:
        dtype = _DTYPES[policy.param_dtype]
        if any(p.is_floating_point() and p.dtype != dtype for p in [*model.parameters(), *model.buffers()]):
            model.to(dtype)
    return model


def cast_inputs(x: Any, policy: pp.PrecisionPolicy | None) -> Any:
    """Floating input tensors in ``policy.param_dtype`` when the policy is "true" (not mixed) and
    narrower than float32 (``"bf16-true"``: the parameters are bfloat16), as Lightning's
    ``HalfPrecision`` converts inputs; anything else unchanged."""
    if policy is None or policy.mixed or policy.param_dtype in ("float32", "float64"):
        return x
    return cast_floating(x, _DTYPES[policy.param_dtype])


def check_kwargs(strategy: pp.Strategy, kwargs: dict[str, Any]) -> None:
    """Refuse ignite options that contradict ``Strategy(precision=, accumulate=)``, naming both."""
    policy = strategy.precision
    amp = kwargs.get("amp_mode")
    if amp is not None and policy is not None:
        raise pp.TopologyError(
            f"create_supervised_trainer(amp_mode={amp!r}) contradicts Strategy(precision={policy.name or policy!r}): "
            "the precision belongs to the polyparallel Strategy, which the adapter maps to autocast on the "
            "runtime's device (ignite's amp_mode autocasts on CUDA only). Leave amp_mode out.")
    scaler = kwargs.get("scaler", False)
    if scaler is not False and scaler is not None and policy is not None:
        scaled = bool(policy.loss_scaling)
        if not scaled or not isinstance(scaler, torch.amp.GradScaler):
            raise pp.TopologyError(
                f"create_supervised_trainer(scaler={scaler!r}) contradicts Strategy(precision="
                f"{policy.name or policy!r}), whose loss scaling is {scaled}: the scaler comes from the Strategy "
                "(a GradScaler on the runtime's device for 'fp16-mixed'). Leave scaler out"
                + (", or pass a torch.amp.GradScaler instance." if scaled else "."))
    steps = kwargs.get("gradient_accumulation_steps", strategy.accumulate)
    if steps != strategy.accumulate:
        raise pp.TopologyError(
            f"create_supervised_trainer(gradient_accumulation_steps={steps!r}) contradicts "
            f"Strategy(accumulate={strategy.accumulate}): the accumulation belongs to the polyparallel Strategy (the "
            f"global batch is micro-batch x accumulate x data). Leave gradient_accumulation_steps out, or use "
            f"Strategy(accumulate={steps!r}).")


def _prepare(batch: Any, device: Any = None, non_blocking: bool = False) -> Any:
    from ignite.engine import _prepare_batch

    return _prepare_batch(batch, device=device, non_blocking=non_blocking)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                  strategy: pp.Strategy, device: torch.device, *, non_blocking: bool = False,
                  prepare_batch: Callable[..., Any] = _prepare,
                  model_transform: Callable[[Any], Any] = lambda output: output,
                  output_transform: Callable[..., Any] = lambda x, y, y_pred, loss: loss.item(),
                  model_fn: Callable[[nn.Module, Any], Any] = lambda model, x: model(x),
                  scaler: Any = None) -> Callable[[Any, Any], Any]:
    """Ignite's ``supervised_training_step_amp`` with the Strategy's precision and accumulation
    (see the module docstring). Returns ``update(engine, batch)`` and, when it scales, sets
    ``update.scaler`` (the trainer puts it in ``engine.state.scaler``)."""
    policy, steps = strategy.precision, strategy.accumulate
    if policy is not None and policy.loss_scaling and not isinstance(scaler, torch.amp.GradScaler):
        scaler = torch.amp.GradScaler(device.type)
    elif policy is None or not policy.loss_scaling:
        scaler = None
    from polyparallel_torch import no_sync

    def update(engine: Any, batch: Any) -> Any:
        iteration = engine.state.iteration
        if (iteration - 1) % steps == 0:
            optimizer.zero_grad()
        model.train()
        x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
        x = cast_inputs(x, policy)
        boundary = iteration % steps == 0
        # One reduction per optimizer step: DDP and FSDP2 skip it in the backward passes between.
        with no_sync(model) if not boundary else contextlib.nullcontext():
            with autocast(policy, device):
                output = model_fn(model, x)
                y_pred = model_transform(output)
                loss = loss_fn(y_pred, y)
            if steps > 1:
                loss = loss / steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if boundary:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        return output_transform(x, y, y_pred, loss * steps)

    update.scaler = scaler  # type: ignore[attr-defined]
    return update
