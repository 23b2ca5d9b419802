"""``Strategy(precision=)`` and ``Strategy(accumulate=)`` on Lightning: its own mechanisms.

- **precision**: Lightning's precision plugin. The Trainer's accelerator connector builds a
  plugin from ``Trainer(precision=)`` (or takes the one in ``plugins=``) and assigns it to the
  strategy while the Trainer is constructed; the adapter's strategy reconciles it with the
  polyparallel Strategy (:func:`reconcile`): Lightning's default (``"32-true"``, which a
  Trainer cannot tell from no value) is replaced by the Strategy's plugin, the same precision
  is kept, and a different one is refused right there, naming both — before ``fit``, before
  any process group. ``Strategy(precision=None)`` leaves Lightning's choice alone.

  =================  =====================================================================
  Strategy preset    Lightning plugin
  =================  =====================================================================
  ``"32"``           ``Precision()`` (``"32-true"``)
  ``"bf16-mixed"``   ``MixedPrecision("bf16-mixed", device)``: bfloat16 autocast, float32
                     parameters, optimizer state and (DDP) gradient reduction
  ``"bf16-true"``    ``HalfPrecision("bf16-true")``: the module converted to bfloat16
  ``"fp16-mixed"``   ``MixedPrecision("16-mixed", device)`` with its ``GradScaler`` (dynamic
                     loss scaling); stage 0 only (Lightning refuses ``"16-mixed"`` under its
                     ``ModelParallelStrategy``, and its scaler does not shard)
  =================  =====================================================================

  Other dtype combinations (``"custom"``) have no Lightning plugin and are refused before
  launch from the capabilities.

- **accumulation**: ``Trainer(accumulate_grad_batches=)``. The adapter sets it to
  ``Strategy(accumulate=N)`` when the Trainer left Lightning's default (1) and refuses another
  value, naming both (:func:`reconcile_accumulation`, at the start of ``fit``, before any step).
  Lightning divides the loss by N and, under DDP, skips the gradient all-reduce of the first
  N-1 micro-batches (``no_sync``): one reduction per optimizer step.
"""

from __future__ import annotations

import importlib
from typing import Any

import polyparallel as pp

__all__ = ["LIGHTNING_NAMES", "RUNS", "REFUSED", "lightning_name", "make_plugin", "reconcile",
           "reconcile_accumulation", "check_stage"]

#: The Strategy's presets and Lightning's names for them.
LIGHTNING_NAMES = {"32": "32-true", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true", "fp16-mixed": "16-mixed"}
#: What the adapter runs (capabilities).
RUNS = frozenset(LIGHTNING_NAMES)
#: Why the rest is refused.
REFUSED = {"custom": "Lightning's precision plugins run its named precisions only ('32-true', 'bf16-mixed', "
                     "'bf16-true', '16-mixed'); another combination of dtypes has no plugin"}


def lightning_name(policy: pp.PrecisionPolicy) -> str:
    """Lightning's ``precision=`` string for a preset policy."""
    if policy.name not in LIGHTNING_NAMES:
        raise pp.UnsupportedTopologyError(f"adapt('lightning') cannot run precision {policy!r}: {REFUSED['custom']}.")
    return LIGHTNING_NAMES[policy.name]


def check_stage(policy: pp.PrecisionPolicy | None, stage: int) -> None:
    """Refuse fp16 with loss scaling at a sharding stage (when the adapter is made)."""
    if policy is not None and policy.loss_scaling and stage > 0:
        raise pp.UnsupportedTopologyError(
            f"adapt('lightning') cannot run precision {policy!r} at sharding stage zero={stage}: Lightning's "
            "ModelParallelStrategy refuses '16-mixed', and its GradScaler does not shard. Use 'bf16-mixed' (no loss "
            "scaling needed), or zero=0.")


def make_plugin(namespace: str, policy: pp.PrecisionPolicy, device_type: str) -> Any:
    """Lightning's precision plugin (of ``namespace``) for ``policy`` on ``device_type``."""
    plugins = importlib.import_module(f"{namespace}.plugins.precision")
    name = lightning_name(policy)
    if name == "32-true":
        return plugins.Precision()
    if name == "bf16-true":
        return plugins.HalfPrecision("bf16-true")
    return plugins.MixedPrecision(name, "cuda" if device_type == "cuda" else device_type)


def _given(plugin: Any) -> str:
    name = getattr(plugin, "precision", None)
    return f"Trainer(precision={name!r})" if name is not None else f"the precision plugin {type(plugin).__name__}"


def reconcile(policy: pp.PrecisionPolicy | None, plugin: Any, namespace: str, device_type: str) -> Any:
    """The plugin the strategy keeps when the Trainer assigns ``plugin`` (see the module docstring).

    :raises pp.TopologyError: ``plugin`` runs another precision than ``policy``; names both.
    """
    if policy is None or plugin is None:
        return plugin
    plugins = importlib.import_module(f"{namespace}.plugins.precision")
    wanted = lightning_name(policy)
    given = getattr(plugin, "precision", None)
    if type(plugin) is plugins.Precision and given == "32-true":
        # Lightning's default, or precision="32-true" (indistinguishable): the Strategy decides.
        return plugin if wanted == "32-true" else make_plugin(namespace, policy, device_type)
    expected = {"bf16-mixed": plugins.MixedPrecision, "16-mixed": plugins.MixedPrecision,
                "bf16-true": plugins.HalfPrecision, "32-true": plugins.Precision}[wanted]
    if given == wanted and isinstance(plugin, expected):
        return plugin
    cpu = (" (Lightning turns precision='16-mixed' into 'bf16-mixed' on CPU)"
           if given == "bf16-mixed" and device_type == "cpu" and wanted == "16-mixed" else "")
    raise pp.TopologyError(
        f"{_given(plugin)} contradicts Strategy(precision={policy.name!r}), which is Lightning's "
        f"precision={wanted!r}{cpu}. The precision belongs to the polyparallel Strategy: leave Trainer(precision=) "
        f"and precision plugins out (or give precision={wanted!r}), or change Strategy(precision=).")


def reconcile_accumulation(strategy: pp.Strategy, trainer: Any) -> None:
    """Set ``trainer.accumulate_grad_batches`` from ``Strategy(accumulate=)``, or refuse another value."""
    wanted, given = strategy.accumulate, getattr(trainer, "accumulate_grad_batches", 1)
    scheduler = next((cb for cb in getattr(trainer, "callbacks", []) or []
                      if type(cb).__name__ == "GradientAccumulationScheduler"), None)
    if scheduler is not None and wanted > 1:
        raise pp.TopologyError(
            f"GradientAccumulationScheduler({getattr(scheduler, 'scheduling', '')}) contradicts "
            f"Strategy(accumulate={wanted}): it would change accumulate_grad_batches during the fit, while the "
            "Strategy's micro-batches are 1/accumulate of each rank's batch. Use one of them: the scheduler with "
            "Strategy(accumulate=1), or the Strategy alone.")
    if given == wanted:
        return
    if given == 1:
        trainer.accumulate_grad_batches = wanted
        return
    raise pp.TopologyError(
        f"Trainer(accumulate_grad_batches={given}) contradicts Strategy(accumulate={wanted}): the accumulation belongs "
        f"to the polyparallel Strategy (the global batch is micro-batch x accumulate x data). Leave "
        f"accumulate_grad_batches out (or set it to {wanted}), or use Strategy(accumulate={given}).")
