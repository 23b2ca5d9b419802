"""What a runtime or adapter can run, declared by its plugin and checked before launch."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._errors import UnsupportedTopologyError
from ._policies import PRECISION_PRESETS, SHARD_STAGES
from ._topology import AXES

if TYPE_CHECKING:
    from ._policies import PrecisionPolicy
    from ._topology import Topology

#: What a target declares for a precision policy that is not one of the presets.
CUSTOM_PRECISION = "custom"

__all__ = ["Capabilities"]


def _names(field: str, target: object, value: object) -> frozenset[str]:
    # A bare string would become a set of its characters: refuse it with the fix.
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"Capabilities({target!r}, {field}=) must be a collection of strings, e.g. {{'x'}}. "
                         f"Received: {value!r}.")
    return frozenset(value)


@dataclass(frozen=True, init=False)
class Capabilities:
    """The axes and features a target (a runtime like ``"torch"`` or an adapter like
    ``"lightning"``) supports.

    :param target: the runtime or adapter name.
    :param axes: axes that may have a size > 1.
    :param features: free-form feature names (``"no_sync"``, ``"bucketing"``, ...) for listings.
    :param plugin: filled in by the plugin manager with the declaring plugin's name.
    :param excludes: sets of axes that cannot all be > 1 at once (``({"tensor", "pipeline"},)``:
        each alone is fine, both together are not).
    :param imports: *runtimes*: the top-level modules the runtime needs (``{"torch"}``). The runtime
        counts as installed when all of them can be imported, and as the process's framework when
        one of them is already imported (see :meth:`polyparallel.Strategy.resolve_runtime`).
    :param backends: *runtimes*: the communication backends ``Strategy(backend=)`` may name
        (``{"gloo", "nccl"}``); empty when the runtime has nothing to choose (``backend`` must
        then be ``None``).
    :param priority: *runtimes*: the automatic choice among several installed runtimes prefers the
        highest priority (ties are an error asking for ``Strategy(runtime=)``; never hook order).
    :param stages: the sharding stages (:class:`polyparallel.ShardPolicy`, ``Strategy(zero=)``) the
        target runs: ``{0}`` (the default) is plain replication; a runtime or adapter adds 1, 2, 3
        as it implements them. A strategy needs its stage in the runtime's and the adapter's set.
    :param stages_with: stages allowed only when an axis is > 1, as ``{axis: (stages, reason)}``:
        ``{"pipeline": ({0, 1}, "the pipeline engine reduces gradients itself")}`` refuses zero=2
        and zero=3 with pipeline > 1, before launch, giving the reason.
    :param runtimes: *adapters*: the runtimes the adapter runs on (``{"torch"}`` for Lightning);
        empty means any. ``Strategy.adapt`` refuses a strategy whose runtime is not one of them.
    :param precisions: the :class:`~polyparallel.PrecisionPolicy` presets the target runs
        (``{"32", "bf16-mixed"}``), plus ``"custom"`` when it maps any combination of dtypes. A
        strategy without a precision (``Strategy(precision=None)``: the model's own dtypes) always
        passes; one with another precision is refused before any process starts.
    :param precision_reasons: why a precision is not run, as ``{name: reason}`` (``{"fp16-mixed":
        "no float16 kernels on the CPU"}``), given in the refusal.
    :param accumulation: the target implements ``Strategy(accumulate=N)`` (micro-batches of
        ``batch_size / (data x N)``, one gradient reduction and optimizer step per N); a strategy
        with ``accumulate > 1`` is refused before any process starts by a target that does not.
    """

    target: str
    axes: frozenset[str]
    features: frozenset[str]
    plugin: str
    excludes: tuple[frozenset[str], ...]
    imports: frozenset[str]
    backends: frozenset[str]
    priority: int
    runtimes: frozenset[str]
    stages: frozenset[int]
    stages_with: tuple[tuple[str, frozenset[int], str], ...]
    precisions: frozenset[str]
    precision_reasons: tuple[tuple[str, str], ...]
    accumulation: bool

    def __init__(self, target: str, axes: Iterable[str] = ("data",), features: Iterable[str] = (), plugin: str = "",
                 excludes: Iterable[Iterable[str]] = (), imports: Iterable[str] = (), backends: Iterable[str] = (),
                 priority: int = 0, runtimes: Iterable[str] = (), stages: Iterable[int] = (0,),
                 stages_with: Mapping[str, tuple[Iterable[int], str]] | tuple[tuple[str, frozenset[int], str], ...] | None = None,
                 precisions: Iterable[str] = ("32",),
                 precision_reasons: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None,
                 accumulation: bool = False):
        # Any collection of names is accepted; frozensets are stored (hashable, comparable to sets).
        if not isinstance(target, str) or not target:
            raise ValueError(f"Capabilities(target=) must be a non-empty string. Received: {target!r}.")
        names = {"axes": axes, "features": features, "imports": imports, "backends": backends, "runtimes": runtimes,
                 "precisions": precisions}
        for field, value in names.items():
            object.__setattr__(self, field, _names(field, target, value))
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "plugin", plugin)
        object.__setattr__(self, "excludes", tuple(_names("excludes", target, e) for e in excludes))
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"Capabilities({target!r}, priority=) must be an int. Received: {priority!r}.")
        object.__setattr__(self, "priority", priority)
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Iterable):
            raise ValueError(f"Capabilities({target!r}, stages=) must be a collection of stages from {SHARD_STAGES}. "
                             f"Received: {stages!r}.")
        stage_set = frozenset(stages)
        if not stage_set or any(isinstance(x, bool) or x not in SHARD_STAGES for x in stage_set):
            raise ValueError(f"Capabilities({target!r}, stages=) must be a non-empty collection of stages from "
                             f"{SHARD_STAGES}. Received: {stages!r}.")
        object.__setattr__(self, "stages", stage_set)
        limits = []
        # The stored form (a tuple of (axis, stages, reason)) comes back through dataclasses.replace.
        items = ([(a, (st, r)) for a, st, r in stages_with] if isinstance(stages_with, tuple)
                 else list((stages_with or {}).items()))
        for axis, spec in items:
            if axis not in AXES or not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str)):
                raise ValueError(f"Capabilities({target!r}, stages_with=) maps an axis of {AXES} to (stages, reason). "
                                 f"Received: {axis!r}: {spec!r}.")
            allowed = frozenset(spec[0])
            if not allowed <= stage_set:
                raise ValueError(f"Capabilities({target!r}, stages_with=) allows stages {sorted(allowed)} with {axis} > 1, "
                                 f"not all among stages={sorted(stage_set)}.")
            limits.append((axis, allowed, spec[1]))
        object.__setattr__(self, "stages_with", tuple(sorted(limits, key=lambda x: x[0])))
        unknown = sorted((self.axes | set().union(*self.excludes)) - set(AXES))
        if unknown:
            raise ValueError(f"Capabilities({target!r}) names unknown axes {unknown}; expected a subset of {AXES}.")
        known = {*PRECISION_PRESETS, CUSTOM_PRECISION}
        strange = sorted(self.precisions - known)
        if strange:
            raise ValueError(f"Capabilities({target!r}, precisions=) names {strange}; expected precision presets "
                             f"{sorted(PRECISION_PRESETS)} or {CUSTOM_PRECISION!r}.")
        reasons = precision_reasons.items() if isinstance(precision_reasons, Mapping) else (precision_reasons or ())
        reasons = tuple(sorted((str(n), str(r)) for n, r in reasons))
        if any(n not in known for n, _ in reasons):
            raise ValueError(f"Capabilities({target!r}, precision_reasons=) names {[n for n, _ in reasons if n not in known]}; "
                             f"expected precision presets or {CUSTOM_PRECISION!r}.")
        object.__setattr__(self, "precision_reasons", reasons)
        if not isinstance(accumulation, bool):
            raise ValueError(f"Capabilities({target!r}, accumulation=) must be True or False. Received: {accumulation!r}.")
        object.__setattr__(self, "accumulation", accumulation)

    def check(self, topology: Topology, stage: int = 0, precision: PrecisionPolicy | None = None,
              accumulate: int = 1) -> None:
        """Raise :class:`UnsupportedTopologyError` when ``topology`` needs an axis not supported,
        sharding ``stage`` is not one of :attr:`stages`, ``precision`` is not one of
        :attr:`precisions` (``None``, the model's own dtypes, always passes), or ``accumulate > 1``
        and the target has no :attr:`accumulation`."""
        if precision is not None:
            self.check_precision(precision)
        if accumulate > 1 and not self.accumulation:
            self.check_accumulation(accumulate)
        if stage not in self.stages:
            by = f" (plugin {self.plugin!r})" if self.plugin else ""
            raise UnsupportedTopologyError(
                f"{self.target!r}{by} cannot run sharding stage zero={stage}: it runs stage(s) "
                f"{', '.join(map(str, sorted(self.stages)))}. Set Strategy(zero=) to one of them, or use a target "
                f"that runs stage {stage} (`polyparallel plugins` lists each target's stages)."
            )
        for axis, allowed, reason in self.stages_with:
            if topology.size(axis) != 1 and stage not in allowed:
                by = f" (plugin {self.plugin!r})" if self.plugin else ""
                raise UnsupportedTopologyError(
                    f"{self.target!r}{by} cannot run sharding stage zero={stage} with {axis}={topology.size(axis)}: "
                    f"{reason}. With {axis} > 1 it runs stage(s) {', '.join(map(str, sorted(allowed)))}; set "
                    f"Strategy(zero=) to one of them, or {axis}=1."
                )
        missing = [a for a in topology.parallel_axes() if a not in self.axes]
        if missing:
            wanted = ", ".join(f"{a}={topology.size(a)}" for a in missing)
            by = f" (plugin {self.plugin!r})" if self.plugin else ""
            raise UnsupportedTopologyError(
                f"{self.target!r}{by} cannot run {wanted}: it supports parallelism along "
                f"{', '.join(sorted(self.axes)) or 'no axis'} only. Set {' and '.join(f'{a}=1' for a in missing)}, "
                f"or use a target that supports it (`polyparallel plugins` lists them)."
            )
        parallel = set(topology.parallel_axes())
        for combination in self.excludes:
            if combination <= parallel:
                wanted = " with ".join(f"{a}={topology.size(a)}" for a in sorted(combination))
                by = f" (plugin {self.plugin!r})" if self.plugin else ""
                raise UnsupportedTopologyError(
                    f"{self.target!r}{by} cannot combine {wanted}; each of these axes works on its own. "
                    "Set one of them to 1."
                )

    def check_precision(self, precision: PrecisionPolicy) -> None:
        """Raise :class:`UnsupportedTopologyError` when the target does not run ``precision``,
        with the target's reason when it declared one."""
        name = precision.name or CUSTOM_PRECISION
        if name in self.precisions:
            return
        by = f" (plugin {self.plugin!r})" if self.plugin else ""
        reason = dict(self.precision_reasons).get(name)
        runs = ", ".join(repr(p) for p in sorted(self.precisions)) or "none"
        raise UnsupportedTopologyError(
            f"{self.target!r}{by} cannot run precision {precision!r}" + (f": {reason}" if reason else "")
            + f". It runs {runs}. Set Strategy(precision=) to one of them (or None: the model's own dtypes), or use a "
            "target that runs it (`polyparallel plugins` lists each target's precisions).")

    def check_accumulation(self, accumulate: int) -> None:
        """Raise :class:`UnsupportedTopologyError` when ``accumulate > 1`` and the target does not
        implement gradient accumulation."""
        if accumulate <= 1 or self.accumulation:
            return
        by = f" (plugin {self.plugin!r})" if self.plugin else ""
        raise UnsupportedTopologyError(
            f"{self.target!r}{by} does not implement gradient accumulation, so it cannot run "
            f"Strategy(accumulate={accumulate}): its micro-batches and steps would not be the ones the strategy "
            "states. Use accumulate=1 (a larger data axis or batch instead), or a target that accumulates "
            "(`polyparallel plugins --json` shows each target's \"accumulation\").")

    def missing_imports(self) -> list[str]:
        """The modules of :attr:`imports` that cannot be imported here (empty: installed).

        Looks the modules up without importing them (``importlib.util.find_spec``)."""
        return sorted(m for m in self.imports if m not in sys.modules and importlib.util.find_spec(m) is None)

    def imported(self) -> bool:
        """Whether one of :attr:`imports` is already imported in this process."""
        return any(m in sys.modules for m in self.imports)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {"target": self.target, "axes": sorted(self.axes), "features": sorted(self.features),
                "plugin": self.plugin, "excludes": [sorted(e) for e in self.excludes],
                "imports": sorted(self.imports), "backends": sorted(self.backends), "priority": self.priority,
                "runtimes": sorted(self.runtimes), "stages": sorted(self.stages),
                "stages_with": {axis: sorted(allowed) for axis, allowed, _ in self.stages_with},
                "precisions": sorted(self.precisions), "accumulation": self.accumulation}
