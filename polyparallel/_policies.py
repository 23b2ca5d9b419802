"""Policies: immutable, picklable value objects that say *how* each operation behaves."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

__all__ = ["DataPolicy", "GradPolicy", "MetricPolicy", "StatePolicy", "Mean", "REDUCE_OPS"]

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
    :param check: check before every ``sync_grads`` that all ranks of the data group are at the
        same call with the same gradient layout (one 16-byte all-reduce a call), so a rank that
        skipped a ``sync_grads`` or runs another operation fails at once naming both sides.
        ``False`` saves that all-reduce on the hot path; the mismatch is then found at the next
        checked operation (``reduce_metrics``, ``sync_states``) or by the timeout. Every other
        operation is always checked. Like every field, it must be the same on every rank.
    """

    op: str = "mean"
    bucket_mb: float | None = None
    check: bool = True

    def __post_init__(self) -> None:
        _choice("GradPolicy.op", self.op, ("mean", "sum"))
        mb = self.bucket_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float))):
            raise ValueError(f"GradPolicy.bucket_mb must be a number of megabytes (> 0) or None. Received: {mb!r} "
                             f"({type(mb).__name__}).")
        if mb is not None and not 0 < mb < math.inf:
            raise ValueError(f"GradPolicy.bucket_mb must be > 0. Received: {mb!r}.")
        if not isinstance(self.check, bool):
            raise ValueError(f"GradPolicy.check must be True or False. Received: {self.check!r}.")

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


