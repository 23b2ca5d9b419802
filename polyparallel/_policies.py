"""Policies: immutable, picklable value objects that say *how* each operation behaves."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

__all__ = ["DataPolicy", "GradPolicy", "MetricPolicy", "PrecisionPolicy", "StatePolicy", "Mean", "REDUCE_OPS"]

#: Reduction ops for plain metric values and gradients.
REDUCE_OPS = ("mean", "sum", "max", "min")
#: What ``sync_states`` does with a state collection.
STATE_ACTIONS = ("mean", "broadcast", "local")
#: What ``shard_data`` does when the data set does not divide over the data axis.
REMAINDERS = ("pad", "drop", "uneven")


def _pairs(where: str, value: Any, what: str, example: str) -> tuple[tuple[str, str], ...]:
    """``name -> str`` pairs from a mapping or an iterable of pairs, refused with an example
    (``dict("sum")`` would otherwise fail with a message about sequence elements)."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        pairs = None
    else:
        pairs = [tuple(p) if isinstance(p, (tuple, list)) else p for p in value]
    if pairs is None or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ValueError(f"{where} must be a mapping of {what}, e.g. {example}, or a list of such pairs. "
                         f"Received: {value!r}.")
    return tuple(pairs)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}. Received: {value!r}.")
    return value


@dataclass(frozen=True)
class DataPolicy:
    """How ``shard_data`` splits data over the data axis.

    :param batch_size: the *global* batch size (summed over data-parallel ranks); each data rank
        gets ``batch_size // data`` samples a step. ``None`` keeps a loader's own ``batch_size`` as
        the *per-rank* size (a data set without a loader then needs one).
    :param shuffle: ``True`` reshuffles every epoch, deterministically from ``(seed, epoch)``
        (:func:`polyparallel.shard_indices`); ``False`` keeps the data set's order. ``None`` (the
        default) inherits: a loader keeps its own choice (``shuffle=True``, i.e. a
        ``RandomSampler``, shuffles; ``shuffle=False``, a ``SequentialSampler``, does not), and
        data without a loader is shuffled. See :meth:`shuffles`.
    :param remainder: when the data set does not divide over the data axis: ``"pad"`` repeats
        samples so every rank gets the same count (training; DistributedSampler's default),
        ``"drop"`` drops the tail, ``"uneven"`` gives each sample exactly once (evaluation: exact
        metrics when reduced count-weighted).
    """

    batch_size: int | None = None
    shuffle: bool | None = None
    remainder: str = "pad"

    def __post_init__(self) -> None:
        _choice("DataPolicy.remainder", self.remainder, REMAINDERS)
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"DataPolicy.batch_size must be a positive int or None. Received: {self.batch_size!r}.")
        if self.shuffle is not None and not isinstance(self.shuffle, bool):
            raise ValueError(f"DataPolicy.shuffle must be True, False or None (inherit the loader's choice). "
                             f"Received: {self.shuffle!r}.")

    def shuffles(self, inherited: bool | None = None) -> bool:
        """Whether to shuffle: :attr:`shuffle` when set, else ``inherited`` (what the user's loader
        does; ``None`` when the data came without one), else ``True``.

        >>> DataPolicy().shuffles(False), DataPolicy().shuffles(), DataPolicy(shuffle=False).shuffles(True)
        (False, True, False)
        """
        if self.shuffle is not None:
            return self.shuffle
        return True if inherited is None else inherited


@dataclass(frozen=True)
class GradPolicy:
    """How ``sync_grads`` reduces gradients over the data axis.

    :param op: ``"mean"`` (the default, matching a single process on the global batch) or ``"sum"``.
    :param bucket_mb: size of the flat buffers gradients are packed into (one collective each);
        ``None`` (the default) leaves it to the runtime: DDP's own buckets (a small first bucket
        that starts communicating early in backward, then 25 MB), 25 MB flat buffers elsewhere.
    :param check: check before every ``sync_grads`` that reduces gradients (a bare module's or a
        list's: on the DDP and FSDP2 models of ``wrap_model`` torch reduced them in backward, see
        ``check_backward``) that all ranks of the data group are at the same call with the same
        gradient layout (one 16-byte all-reduce a call), so a rank that
        skipped a ``sync_grads`` or runs another operation fails at once naming both sides.
        ``False`` saves that all-reduce on the hot path; the mismatch is then found at the next
        checked operation (``reduce_metrics``, ``sync_states``) or by the timeout. Every other
        operation is always checked. Like every field, it must be the same on every rank.
    :param check_backward: also identity-check the gradient reduction torch runs in ``backward()``
        on a model ``wrap_model`` wrapped in DDP (the torch runtime at zero=0, Lightning, Ignite,
        fastai) or FSDP2 (zero=2/3), or a pipeline stage (FSDP2 or HSDP). On DDP the check is started once
        per ``backward()``, before DDP's gradient all-reduces, and answered when the gradients are
        computed, so that an operation one rank runs while its peer is in a backward
        (``self.log(..., sync_dist=True)`` of a key only one rank logs) fails at once naming both
        sides; on FSDP2 and a pipeline stage it is ``sync_grads``'s check (there ``sync_grads``
        has nothing to reduce). ``False`` (the default): every such backward is still recorded,
        an operation out of step with it ends at the timeout in the hang report, which names the
        peer's backward, its line and its stack, and ``sync_grads`` on these models does nothing,
        as on DDP. Off by default because it is not free: one more all-reduce every step, waited
        for (1.12x the step's CPU time on the 5.1 ms DDP step of ``benchmarks/bench_torch.py
        --only ddp-trace``, about 0.5 ms a step under FSDP2 on gloo; on CUDA, a host/device
        synchronisation per step), as torch keeps its own collective checks behind
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Turn it on while looking for a desync.
    :param accumulate: gradient accumulation: the optimizer steps once every ``accumulate``
        micro-batches, and gradients are reduced over the data axis once per step, not per
        micro-batch. The global batch (``DataPolicy.batch_size``) is ``micro-batch x accumulate x
        data``, in every framework (``Strategy(accumulate=)`` is the shortcut).
    """

    op: str = "mean"
    bucket_mb: float | None = None
    check: bool = True
    accumulate: int = 1
    check_backward: bool = False

    def __post_init__(self) -> None:
        _choice("GradPolicy.op", self.op, ("mean", "sum"))
        mb = self.bucket_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float))):
            raise ValueError(f"GradPolicy.bucket_mb must be a number of megabytes (> 0) or None. Received: {mb!r} "
                             f"({type(mb).__name__}).")
        if mb is not None and not 0 < mb < math.inf:
            raise ValueError(f"GradPolicy.bucket_mb must be > 0. Received: {mb!r}.")
        for name in ("check", "check_backward"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"GradPolicy.{name} must be True or False. Received: {value!r}.")
        n = self.accumulate
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"GradPolicy.accumulate must be a positive int (micro-batches per optimizer step). "
                             f"Received: {n!r}.")

    def bucket_bytes(self, default_mb: float = 25.0) -> int:
        """The bucket size in bytes (``default_mb`` when :attr:`bucket_mb` is ``None``)."""
        return int((self.bucket_mb if self.bucket_mb is not None else default_mb) * 1024 * 1024)


@dataclass(frozen=True)
class ShardPolicy:
    """How much of the training state is sharded over the data axis (ZeRO stages).

    The stage means the same thing in every target that declares it
    (:attr:`polyparallel.Capabilities.stages`); a target that cannot run the stage asked for is
    refused before any process starts, with the stages it can run.

    :param stage: ``0`` replicates everything on every data rank (classic data parallelism, the
        default); ``1`` shards the optimizer state; ``2`` also the gradients; ``3`` also the
        parameters (gathered for forward and backward, as FSDP and DeepSpeed ZeRO-3 do). Sharding
        is over the data axis only: tensor and pipeline axes keep their own split of the model.
    """

    stage: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in SHARD_STAGES:
            raise ValueError(f"ShardPolicy.stage must be one of {', '.join(map(str, SHARD_STAGES))} "
                             f"(0 replicate, 1 optimizer state, 2 + gradients, 3 + parameters). Received: {self.stage!r}.")


SHARD_STAGES = (0, 1, 2, 3)

#: The floating-point dtypes a PrecisionPolicy names (framework-free spellings), widest first.
DTYPES = ("float64", "float32", "bfloat16", "float16")
_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}
#: Named presets: (param, compute, reduce, optimizer, loss scaling).
PRECISION_PRESETS: dict[str, tuple[str, str, str, str, bool]] = {
    "32": ("float32", "float32", "float32", "float32", False),
    "bf16-mixed": ("float32", "bfloat16", "float32", "float32", False),
    "bf16-true": ("bfloat16", "bfloat16", "bfloat16", "bfloat16", False),
    "fp16-mixed": ("float32", "float16", "float32", "float32", True),
}
#: Other spellings users bring from Lightning and elsewhere.
PRECISION_ALIASES = {"32-true": "32", "fp32": "32", "bf16": "bf16-mixed", "16-mixed": "fp16-mixed"}


@dataclass(frozen=True, init=False)
class PrecisionPolicy:
    """The numeric precision of training: the dtypes that matter in parallel training.

    Build it from a preset name (``PrecisionPolicy("bf16-mixed")``, or ``Strategy(precision=
    "bf16-mixed")``) or from explicit fields (``PrecisionPolicy(compute_dtype="bfloat16",
    reduce_dtype="bfloat16")``: fields not given are ``float32``). Every target maps it to its
    framework's own mechanism (autocast, Lightning's precision plugin, FSDP2's
    ``MixedPrecisionPolicy``, DeepSpeed's ``bf16``/``fp16`` sections, a JAX compute dtype), and a
    target that cannot run it refuses it before any process starts
    (:attr:`polyparallel.Capabilities.precisions`).

    Presets: ``"32"`` (everything float32), ``"bf16-mixed"`` (float32 parameters and optimizer
    state, bfloat16 compute, float32 gradient reduction), ``"bf16-true"`` (everything bfloat16),
    ``"fp16-mixed"`` (as bf16-mixed with float16 compute and dynamic loss scaling). Aliases:
    ``"32-true"``, ``"fp32"``, ``"bf16"``, ``"16-mixed"``.

    :param param_dtype: the dtype the parameters are kept in (the weights the optimizer updates:
        the master copy under mixed precision).
    :param compute_dtype: the dtype forward and backward run in; narrower than ``param_dtype``
        means mixed precision (autocast), equal means "true" precision.
    :param reduce_dtype: the dtype gradients are reduced in over the data axis.
    :param optimizer_dtype: the dtype of the optimizer's state (moments).
    :param loss_scaling: dynamic loss scaling (a gradient scaler), for float16 compute only.
    """

    param_dtype: str
    compute_dtype: str
    reduce_dtype: str
    optimizer_dtype: str
    loss_scaling: bool

    def __init__(self, preset: str | None = None, *, param_dtype: str | None = None, compute_dtype: str | None = None,
                 reduce_dtype: str | None = None, optimizer_dtype: str | None = None, loss_scaling: bool | None = None):
        explicit: dict[str, Any] = {"param_dtype": param_dtype, "compute_dtype": compute_dtype, "reduce_dtype": reduce_dtype,
                    "optimizer_dtype": optimizer_dtype, "loss_scaling": loss_scaling}
        if preset is not None:
            given = [k for k, v in explicit.items() if v is not None]
            if given:
                raise ValueError(f"PrecisionPolicy takes a preset name or explicit fields, not both. Received "
                                 f"{preset!r} and {', '.join(given)}.")
            if not isinstance(preset, str) or PRECISION_ALIASES.get(preset, preset) not in PRECISION_PRESETS:
                names = ", ".join(map(repr, PRECISION_PRESETS))
                aliases = ", ".join(f"{a!r} ({n})" for a, n in PRECISION_ALIASES.items())
                raise ValueError(f"PrecisionPolicy: unknown preset {preset!r}; the presets are {names} (aliases: "
                                 f"{aliases}), or give the fields (param_dtype=, compute_dtype=, reduce_dtype=, "
                                 f"optimizer_dtype=, loss_scaling=).")
            values = dict(zip(explicit, PRECISION_PRESETS[PRECISION_ALIASES.get(preset, preset)]))
        else:
            values = {k: v for k, v in explicit.items() if v is not None}
            for field in ("param_dtype", "compute_dtype", "reduce_dtype", "optimizer_dtype"):
                values.setdefault(field, "float32")
            values.setdefault("loss_scaling", values["compute_dtype"] == "float16")
        for field in ("param_dtype", "compute_dtype", "reduce_dtype", "optimizer_dtype"):
            _choice(f"PrecisionPolicy.{field}", values[field], DTYPES)
        if not isinstance(values["loss_scaling"], bool):
            raise ValueError(f"PrecisionPolicy.loss_scaling must be True or False. Received: {values['loss_scaling']!r}.")
        param, compute = str(values["param_dtype"]), str(values["compute_dtype"])
        if _BITS[compute] > _BITS[param]:
            raise ValueError(f"PrecisionPolicy(param_dtype={param!r}, compute_dtype={compute!r}): compute is wider than "
                             "the parameters, which gains no precision; use the same dtype, or keep the parameters in "
                             f"{compute!r} and compute in a narrower one (mixed precision).")
        if _BITS[compute] == _BITS[param] and compute != param:
            raise ValueError(f"PrecisionPolicy(param_dtype={param!r}, compute_dtype={compute!r}): two 16-bit dtypes; "
                             "compute in the parameters' dtype, or keep the parameters in float32.")
        if values["loss_scaling"] and compute != "float16":
            raise ValueError(f"PrecisionPolicy(loss_scaling=True) is for float16 compute (its small exponent range "
                             f"underflows gradients); compute_dtype is {compute!r}, whose range needs no scaling.")
        for field, value in values.items():
            object.__setattr__(self, field, value)

    @property
    def name(self) -> str | None:
        """The preset these fields are (``"bf16-mixed"``), or ``None`` for another combination."""
        key = (self.param_dtype, self.compute_dtype, self.reduce_dtype, self.optimizer_dtype, self.loss_scaling)
        return next((n for n, fields in PRECISION_PRESETS.items() if fields == key), None)

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a narrower dtype than the parameters (autocast)."""
        return self.compute_dtype != self.param_dtype

    def dtypes(self) -> dict[str, str]:
        """``{"param": ..., "compute": ..., "reduce": ..., "optimizer": ...}``."""
        return {"param": self.param_dtype, "compute": self.compute_dtype, "reduce": self.reduce_dtype,
                "optimizer": self.optimizer_dtype}

    def __repr__(self) -> str:
        if self.name is not None:
            return f"PrecisionPolicy({self.name!r})"
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in ("param_dtype", "compute_dtype", "reduce_dtype",
                                                                  "optimizer_dtype", "loss_scaling"))
        return f"PrecisionPolicy({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_precision, (self.param_dtype, self.compute_dtype, self.reduce_dtype, self.optimizer_dtype,
                             self.loss_scaling))


def _precision(param: str, compute: str, reduce: str, optimizer: str, scaling: bool) -> PrecisionPolicy:
    return PrecisionPolicy(param_dtype=param, compute_dtype=compute, reduce_dtype=reduce, optimizer_dtype=optimizer,
                           loss_scaling=scaling)


@dataclass(frozen=True)
class MetricPolicy:
    """How ``reduce_metrics`` reduces plain (non-:class:`Mean`) values over the data axis.

    :param op: the default op for plain values: ``mean``, ``sum``, ``max`` or ``min``.
    :param ops: per-metric-name overrides, e.g. ``{"samples": "sum"}``.
    """

    op: str = "mean"
    ops: tuple[tuple[str, str], ...] = ()

    def __init__(self, op: str = "mean", ops: Mapping[str, str] | Iterable[tuple[str, str]] = ()):
        pairs = _pairs("MetricPolicy(ops=)", ops, "metric name (str) -> op", "{'samples': 'sum'}")
        if len({name for name, _ in pairs}) != len(pairs):
            raise ValueError(f"MetricPolicy(ops=) names a metric twice. Received: {ops!r}.")
        pairs = tuple(sorted(pairs))
        _choice("MetricPolicy.op", op, REDUCE_OPS)
        for name, o in pairs:
            _choice(f"MetricPolicy.ops[{name!r}]", o, REDUCE_OPS)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "ops", pairs)

    def op_for(self, name: str) -> str:
        """The reduction op for metric ``name``."""
        return dict(self.ops).get(name, self.op)


#: Rules applied after the user's: BatchNorm statistics are averaged, counters and random state
#: stay local, everything else (parameters) is broadcast from data rank 0.
DEFAULT_STATE_RULES: tuple[tuple[str, str], ...] = (
    ("*running_mean", "mean"),
    ("*running_var", "mean"),
    ("batch_stats*", "mean"),
    ("*num_batches_tracked", "local"),
    ("*rng*", "local"),
    ("*key*", "local"),
    ("*count*", "local"),
)


@dataclass(frozen=True)
class StatePolicy:
    """What ``sync_states`` does with each state collection, by name or glob pattern.

    Actions: ``mean`` (average over the data axis: BatchNorm running statistics), ``broadcast``
    (copy from data rank 0: parameters at start), ``local`` (leave alone: RNG keys, counters).
    User rules are matched first, in order, then :data:`DEFAULT_STATE_RULES`, then ``default``.

    >>> StatePolicy({"encoder.*": "local"}).action_for("encoder.bn.running_mean")
    'local'
    >>> StatePolicy().action_for("bn.running_mean"), StatePolicy().action_for("fc.weight")
    ('mean', 'broadcast')
    """

    rules: tuple[tuple[str, str], ...] = ()
    default: str = "broadcast"
    use_defaults: bool = True

    def __init__(
        self,
        rules: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        default: str = "broadcast",
        use_defaults: bool = True,
    ):
        pairs = _pairs("StatePolicy(rules=)", rules, "name pattern (str) -> action", "{'encoder.*': 'local'}")
        for pattern, action in pairs:
            _choice(f"StatePolicy action for {pattern!r}", action, STATE_ACTIONS)
        _choice("StatePolicy.default", default, STATE_ACTIONS)
        if not isinstance(use_defaults, bool):
            raise ValueError(f"StatePolicy.use_defaults must be True or False. Received: {use_defaults!r}.")
        object.__setattr__(self, "rules", pairs)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "use_defaults", bool(use_defaults))

    def action_for(self, name: str) -> str:
        """The action for the state named ``name`` (first matching rule wins)."""
        rules = self.rules + (DEFAULT_STATE_RULES if self.use_defaults else ())
        for pattern, action in rules:
            if fnmatchcase(name, pattern):
                return action
        return self.default


@dataclass(frozen=True)
class Mean:
    """A metric value reduced count-weighted: ``sum(total) / sum(count)`` over the data axis.

    A mean over 3 samples and a mean over 5 samples combine as ``(t1 + t2) / 8``, not as the mean
    of two means. ``total`` may be a number or a scalar tensor/array of a runtime.

    >>> (Mean(6.0, 3) + Mean(10.0, 5)).value
    2.0
    """

    total: Any
    count: Any = 1

    def __post_init__(self) -> None:
        # Cheap (Means are made every step): only what no runtime can reduce.
        for name, value in (("total", self.total), ("count", self.count)):
            if value is None or isinstance(value, (str, bytes)):
                raise TypeError(f"Mean({name}=) must be a number or a scalar tensor/array. Received: {value!r}"
                                + (f"; convert it first: float({value!r})." if isinstance(value, str) else "."))

    @classmethod
    def of(cls, value: float, count: int) -> Mean:
        """A mean ``value`` over ``count`` samples."""
        return cls(value * count, count)

    @property
    def value(self) -> float:
        """``total / count`` as a float (NaN for a zero count)."""
        count = float(self.count)
        return float(self.total) / count if count else math.nan

    def __add__(self, other: Mean) -> Mean:
        if not isinstance(other, Mean):
            return NotImplemented
        return Mean(self.total + other.total, self.count + other.count)

    def __float__(self) -> float:
        return self.value


