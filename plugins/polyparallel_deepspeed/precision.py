"""``Strategy(precision=)`` on DeepSpeed: each :class:`polyparallel.PrecisionPolicy` preset and
the DeepSpeed config it writes.

Framework-free (no torch, no deepspeed import): :func:`apply` runs inside
:func:`~.config.build_config`, before any process group or collective.

=================  ===========================================================================
precision          the DeepSpeed config written
=================  ===========================================================================
``None``           nothing: no ``bf16``/``fp16`` section (DeepSpeed's default, fp32)
``"32"``           nothing (fp32); a ``bf16``/``fp16`` section enabled in the config is refused
``"bf16-mixed"``   ``bf16: {enabled: true}`` and ``communication_data_type: "fp32"``
``"fp16-mixed"``   ``fp16: {enabled: true, loss_scale: 0}`` (DeepSpeed's dynamic loss scaler);
                   written, but refused before launch here (:data:`~.capabilities.PRECISION_REASONS`)
=================  ===========================================================================

DeepSpeed's ``bf16`` mode is mixed precision by keeping two copies: the module is converted to
bfloat16 (forward and backward run in it: ``compute_dtype``), and the optimizer (DeepSpeed's
fp16/bf16 wrapper at ZeRO-0, its ZeRO optimizer at 1-3) keeps a float32 master copy of the
parameters and float32 optimizer state, which it updates (``param_dtype`` and
``optimizer_dtype`` float32), then copies back to the bfloat16 module. Gradients are reduced in
``communication_data_type``, which DeepSpeed defaults to the module's dtype (bfloat16) and the
adapter sets from ``reduce_dtype`` (float32 for ``"bf16-mixed"``). DeepSpeed converts the module,
not its inputs: feed floating inputs in the module's dtype (``x.to(engine.get_data_types()[0])``,
``torch.bfloat16`` here), as with a hand-written bf16 config. At ZeRO-0 DeepSpeed's bf16 wrapper
accumulates micro-batch gradients (``accumulate > 1``) in the bfloat16 module's ``.grad`` (its
``data_types.grad_accum_dtype`` defaults to the module's dtype), where autocast accumulates in
float32 ``.grad``.

Against the autocast frameworks (plain torch's ``wrap_model``, Lightning, Ignite, fastai at
``"bf16-mixed"``) this is a different scheme with the same tolerances:
``tests/deepspeed_plugin/test_precision_frameworks.py`` checks DeepSpeed's loss curve within 1%
relative of plain torch's autocast curve and its float32 master weights within 2.5e-3 (data=2,
accumulate 1 and 2, ZeRO 0-3), and equal to plain torch bit for bit at ``"32"``.

A user config that says otherwise is refused, naming both values (:class:`polyparallel.TopologyError`):
a ``bf16``/``fp16`` section whose ``enabled`` contradicts the Strategy (or any enabled section
when the Strategy sets no precision: the precision is set once, on the Strategy), a
``communication_data_type`` other than the one ``reduce_dtype`` implies, and section options
beyond ``enabled`` (and a consistent ``fp16.loss_scale``), which are not tested here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polyparallel as pp

__all__ = ["SECTIONS", "apply", "sections"]

#: DeepSpeed's spelling of a PrecisionPolicy dtype.
DS_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: The config sections a precision writes.
SECTIONS = ("bf16", "fp16")


def sections(policy: pp.PrecisionPolicy | None) -> dict[str, Any]:
    """The DeepSpeed config entries ``policy`` writes (empty: fp32, DeepSpeed's default)."""
    if policy is None or policy.compute_dtype == "float32":
        return {}
    if policy.compute_dtype == "bfloat16":
        return {"bf16": {"enabled": True}, "communication_data_type": DS_DTYPE[policy.reduce_dtype]}
    if policy.compute_dtype == "float16":
        # loss_scale 0 is DeepSpeed's dynamic loss scaler; a positive value is a static scale.
        return {"fp16": {"enabled": True, "loss_scale": 0 if policy.loss_scaling else 1.0},
                "communication_data_type": DS_DTYPE[policy.reduce_dtype]}
    raise pp.UnsupportedTopologyError(f"The DeepSpeed adapter cannot run {policy!r}: DeepSpeed computes in float32, "
                                      "bfloat16 or float16.")


def _named(strategy: pp.Strategy) -> str:
    policy = strategy.precision
    return "no precision (Strategy(precision=None): fp32)" if policy is None else f"precision {policy!r}"


def apply(out: dict[str, Any], strategy: pp.Strategy) -> None:
    """Write the Strategy's precision into ``out`` (a copy of the user's config), refusing a
    user value that contradicts it, naming both."""
    wanted = sections(strategy.precision)
    where = f"({strategy!r})"
    if wanted and strategy.topology.size("pipeline") > 1:
        raise pp.UnsupportedTopologyError(
            f"The DeepSpeed adapter runs {_named(strategy)} with data parallelism only: DeepSpeed's pipeline engine "
            "with bf16/fp16 (its BF16_Optimizer, gradients accumulated in bfloat16) is not tested against a single "
            "process here. Use pipeline=1, or precision='32' with the pipeline.")
    for key in SECTIONS:
        given = out.get(key)
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise pp.TopologyError(f"DeepSpeed config {key} must be a dict. Received: {given!r}.")
        enabled = given.get("enabled", False)  # DeepSpeed's default for both sections
        on = key in wanted
        if bool(enabled) != on:
            fix = (f"Set the precision on the Strategy (Strategy(precision={'bf16-mixed' if key == 'bf16' else 'fp16-mixed'!r}))"
                   if not on else f"Drop {key} from the config")
            raise pp.TopologyError(
                f"The DeepSpeed config's {key}.enabled={enabled!r} contradicts the Strategy's {_named(strategy)} "
                f"{where}, which {'writes' if on else 'has no'} {key} section{'' if not on else ' enabled'}. {fix}; "
                "the adapter writes the precision sections from it.")
        extra = sorted(set(given) - {"enabled"} - ({"loss_scale"} if key == "fp16" else set()))
        if extra:
            raise pp.TopologyError(f"DeepSpeed config {key}.{extra[0]} is not tested by polyparallel (the adapter writes "
                                   f"{key} from Strategy(precision=) as {wanted.get(key, {'enabled': False})}); leave it "
                                   "out.")
        if on and "loss_scale" in given and (given["loss_scale"] == 0) != (wanted[key]["loss_scale"] == 0):
            raise pp.TopologyError(
                f"The DeepSpeed config's fp16.loss_scale={given['loss_scale']!r} contradicts the Strategy's "
                f"{_named(strategy)} {where}, whose loss_scaling={strategy.precision.loss_scaling if strategy.precision else False} "
                "(loss_scale 0 is DeepSpeed's dynamic scaler). Set loss scaling on the Strategy's PrecisionPolicy.")
    comm = out.get("communication_data_type")
    if comm is not None and comm != wanted.get("communication_data_type"):
        mine = wanted.get("communication_data_type")
        reduce = strategy.precision.reduce_dtype if strategy.precision is not None else None
        raise pp.TopologyError(
            f"The DeepSpeed config's communication_data_type={comm!r} contradicts the Strategy's {_named(strategy)} "
            f"{where}" + (f", whose reduce_dtype={reduce!r} is {mine!r}" if mine else ", which reduces in the model's dtype")
            + ". Set the reduction dtype on the Strategy (PrecisionPolicy(reduce_dtype=)); the adapter writes "
            "communication_data_type from it.")
    for key, value in wanted.items():
        if isinstance(value, dict):
            out[key] = {**value, **{k: v for k, v in (out.get(key) or {}).items() if k != "enabled"}}
        else:
            out[key] = value
