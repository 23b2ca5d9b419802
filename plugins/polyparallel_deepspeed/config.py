"""The DeepSpeed config a Strategy implies, merged with the user's own options.

Framework-free (no torch, no deepspeed import): the whole decision is made, and every
contradiction refused, before any process group or collective exists.

What the Strategy decides (a user value that differs is an error naming both):

======================================  =============================================================
DeepSpeed key                           from
======================================  =============================================================
``zero_optimization.stage``             ``strategy.shard_policy.stage`` (``Strategy(zero=)``)
``train_batch_size``                    ``strategy.data_policy.batch_size`` (the global batch) when set
``gradient_accumulation_steps``         ``strategy.accumulate`` (``Strategy(accumulate=)``)
``train_micro_batch_size_per_gpu``      ``pp.micro_batch_size(batch, data, accumulate)``, so that
                                        ``train_batch_size = micro x accumulate x data`` (DeepSpeed's rule)
``bf16``, ``fp16``,                     ``strategy.precision`` (:mod:`.precision`)
``communication_data_type``
======================================  =============================================================

Defaults that make DeepSpeed behave as plain PyTorch does unless the user asks otherwise
(each one only where the user's config does not set the key):

- ``gradient_clipping: 0.0`` — DeepSpeed clips the gradient norm at 1.0 by default.
- ``zero_allow_untested_optimizer: true`` when a torch optimizer object is given at ZeRO >= 1
  (DeepSpeed refuses any optimizer it did not write otherwise; torch's optimizers work, and the
  parity tests check SGD at every stage).
- ``optimizer: {"type": "Adam", ...}`` gets ``params.adam_w_mode: false``: DeepSpeed's "Adam"
  (with or without ``torch_adam``) silently runs AdamW (decoupled weight decay) unless
  ``adam_w_mode`` is set, where PyTorch's ``Adam`` adds weight decay to the gradient. Set
  ``adam_w_mode: true`` (or ``"type": "AdamW"``) to get AdamW.

Refused (:class:`UnsupportedConfigError`, naming the key and why): every key and ZeRO option the
declared surface (:mod:`.surface`, ``docs/surface/deepspeed.md``) classifies as refused, and keys
DeepSpeed does not read at all (a misspelt key DeepSpeed would ignore silently). A section given
as ``{"enabled": false}`` is off and accepted.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import polyparallel as pp

from .capabilities import CAPABILITIES, PIPELINE_ZERO_REASON
from .precision import apply as apply_precision

__all__ = ["PIPELINE_ZERO_REASON", "UnsupportedConfigError", "build_config", "check_strategy"]


class UnsupportedConfigError(pp.PolyparallelError, ValueError):
    """A DeepSpeed config key or option the adapter refuses (see ``docs/surface/deepspeed.md``),
    refused before any process group or collective."""

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_strategy(strategy: pp.Strategy) -> None:
    """Refuse what DeepSpeed cannot run, before anything starts: the adapter's declared
    capabilities (axes, ZeRO stages, no ZeRO 2/3 with a pipeline, with DeepSpeed's reason,
    the precisions it runs, with the reason for the others),
    which ``pp.launch(runtime="deepspeed")`` and ``adapt`` check as well."""
    CAPABILITIES.check(strategy.topology, strategy.shard_policy.stage, strategy.precision, strategy.accumulate)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise pp.TopologyError(f"DeepSpeed config {name} must be a positive int. Received: {value!r}.")
    return value


def _resolve_batch(config: dict[str, Any], strategy: pp.Strategy, data: int, micro_batch_size: int | None) -> None:
    given = {k: _positive_int(k, config[k]) for k in _BATCH_KEYS if config.get(k) is not None}
    steps = strategy.accumulate
    if given.get("gradient_accumulation_steps", steps) != steps:
        raise pp.TopologyError(
            f"The DeepSpeed config's gradient_accumulation_steps={given['gradient_accumulation_steps']} contradicts the "
            f"Strategy's accumulate={steps} ({strategy!r}). Set the accumulation once, on the Strategy "
            "(Strategy(accumulate=N)); the adapter writes gradient_accumulation_steps from it.")
    if micro_batch_size is not None:
        micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        key = "train_micro_batch_size_per_gpu"
        if key in given and given[key] != micro_batch_size:
            raise pp.TopologyError(f"adapt('deepspeed', micro_batch_size={micro_batch_size}) contradicts the config's "
                                   f"{key}={given[key]}; give one of them.")
        given[key] = micro_batch_size
    strategy_batch = strategy.data_policy.batch_size
    total = given.get("train_batch_size")
    if strategy_batch is not None and total is not None and total != strategy_batch:
        raise pp.TopologyError(
            f"The DeepSpeed config's train_batch_size={total} contradicts the Strategy's global batch size "
            f"{strategy_batch} ({strategy!r}). Drop train_batch_size from the config (the adapter fills it from the "
            "Strategy) or make them equal.")
    total = strategy_batch if strategy_batch is not None else total
    micro = given.get("train_micro_batch_size_per_gpu")
    rule = (f"train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps ({steps}, the Strategy's "
            f"accumulate) x data ({data})")
    if total is None:
        if micro is None:
            raise pp.TopologyError(
                "The DeepSpeed adapter needs a batch size: set the global one on the Strategy "
                "(Strategy(batch_size=...)), or train_micro_batch_size_per_gpu in the config (or micro_batch_size=).")
        total = micro * steps * data
    elif micro is None:
        try:
            micro = pp.micro_batch_size(total, data, steps)
        except ValueError as exc:
            raise pp.TopologyError(f"DeepSpeed: {exc} ({rule}).") from None
    if micro * steps * data != total:
        raise pp.TopologyError(
            f"The DeepSpeed batch sizes contradict the Strategy: train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={steps} x data={data} = {micro * steps * data}, but the global batch size is "
            f"{total} ({rule}; data is the Strategy's data size).")
    config.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=steps)


def build_config(strategy: pp.Strategy, config: Mapping[str, Any] | None = None, *, data_size: int | None = None,
                 torch_optimizer: bool = False, micro_batch_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config for ``strategy``: the user's ``config`` (a copy; never changed) with
    the Strategy's ZeRO stage and batch sizes, and the PyTorch-like defaults of this module.

    :param data_size: the data axis size (default: the strategy's, which must then be resolved).
    :param torch_optimizer: a torch optimizer object is passed to ``deepspeed.initialize``.
    :param micro_batch_size: ``train_micro_batch_size_per_gpu`` given as an argument instead of a
        config key (``gradient_accumulation_steps`` is the Strategy's ``accumulate``).
    :raises polyparallel.TopologyError: a user value contradicts the Strategy (named both), or the
        batch sizes do not fit together.
    :raises polyparallel.UnsupportedTopologyError: pipeline > 1 with ZeRO 2/3.
    :raises UnsupportedConfigError: a key or ZeRO option the surface refuses, or one DeepSpeed does not read.
    """
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"adapt('deepspeed', config=) must be a dict of DeepSpeed options (a path is not read here: "
                        f"json.load it first). Received: {type(config).__name__}.")
    check_strategy(strategy)
    from .surface import refusal  # here: `python -m polyparallel_deepspeed.surface` runs it as __main__

    why = refusal(config)
    if why is not None:
        raise UnsupportedConfigError(f"adapt('deepspeed', config=): {why}.")
    out: dict[str, Any] = copy.deepcopy(dict(config))
    stage = strategy.shard_policy.stage
    zero = out.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise pp.TopologyError(f"DeepSpeed config zero_optimization must be a dict. Received: {zero!r}.")
    zero = dict(zero)
    if "stage" in zero and zero["stage"] != stage:
        raise pp.TopologyError(
            f"The DeepSpeed config's zero_optimization.stage={zero['stage']!r} contradicts the Strategy's sharding stage "
            f"zero={stage} ({strategy!r}). Set the stage once, on the Strategy (Strategy(zero=N)); the adapter writes it "
            "into the config.")
    zero["stage"] = stage
    out["zero_optimization"] = zero
    data = strategy.topology.size("data") if data_size is None else data_size
    if data < 1:
        raise pp.TopologyError(f"build_config() needs a resolved data size; the topology is {strategy.topology!r}: "
                               "pass data_size=.")
    _resolve_batch(out, strategy, data, micro_batch_size)
    apply_precision(out, strategy)
    out.setdefault("gradient_clipping", 0.0)
    if torch_optimizer and stage >= 1:
        out.setdefault("zero_allow_untested_optimizer", True)
    optimizer = out.get("optimizer")
    if isinstance(optimizer, Mapping) and str(optimizer.get("type", "")).lower() == "adam":
        params = dict(optimizer.get("params") or {})
        params.setdefault("adam_w_mode", False)
        out["optimizer"] = {**optimizer, "params": params}
    return out
