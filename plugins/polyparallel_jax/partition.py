"""Partition rules: which parameters are split along the ``tensor`` axis, and how.

A *plan* is a sequence of ``(pattern, spec)`` rules. ``pattern`` is a regular expression searched
in a parameter's path (``"encoder/layers/0/kernel"``); ``spec`` is a ``PartitionSpec``-like tuple
of axis names or ``None`` per dimension (``(None, "tensor")`` splits a kernel's output features:
a Megatron column-parallel layer; ``("tensor", None)`` splits its input features: row-parallel).
The first matching rule wins; parameters no rule matches are replicated. Every rule must match at
least one parameter, so a typo is an error instead of a silently replicated model.

Without a plan, :func:`megatron_mlp_plan` alternates column- and row-parallel ``Linear`` layers
(Megatron's MLP split: one all-reduce per pair of layers), replicating layers whose features do
not divide by the tensor size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["PlanError", "Rule", "megatron_mlp_plan", "normalize_plan", "param_specs", "path_name"]

import polyparallel as pp

Rule = tuple[str, tuple[Any, ...]]


class PlanError(pp.PolyparallelError, ValueError):
    """A partition plan that does not fit the model or the tensor axis (raised before compiling;
    a ``PolyparallelError``, so the plugin manager passes it through unwrapped)."""


# NNX state leaves are Variables whose array sits under the attribute "value"; it is not part of
# the name users write rules against.
_VALUE_ATTRS = ("value", "raw_value", "_raw_value")


def path_name(path: Sequence[Any]) -> str:
    """``"a/b/0/kernel"`` for a ``jax.tree_util`` key path (dict keys, indices, attributes)."""
    parts = []
    for key in path:
        if hasattr(key, "key"):
            parts.append(str(key.key))
        elif hasattr(key, "idx"):
            parts.append(str(key.idx))
        elif hasattr(key, "name"):
            if key.name in _VALUE_ATTRS:
                continue
            parts.append(str(key.name))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _is_partition_spec(spec: Any) -> bool:
    # By isinstance, not by class name: in jax 0.10 the class is named ``P`` and is no tuple.
    import sys

    sharding = sys.modules.get("jax.sharding")
    return sharding is not None and isinstance(spec, sharding.PartitionSpec)


def normalize_plan(plan: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[Rule]:
    """Validate a plan given as a mapping or a sequence of ``(pattern, spec)`` pairs."""
    pairs = list(plan.items()) if isinstance(plan, Mapping) else list(plan)
    rules: list[Rule] = []
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise PlanError(f"A partition rule is a (pattern, spec) pair with a regex string pattern. Received: {item!r}.")
        pattern, spec = item
        try:
            re.compile(pattern)
        except re.error as exc:
            raise PlanError(f"Partition rule pattern {pattern!r} is not a valid regular expression: {exc}.") from None
        spec = tuple(spec) if isinstance(spec, (tuple, list)) or _is_partition_spec(spec) else (spec,)
        for entry in spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            for name in names:
                if name is not None and name not in ("data", "tensor", "pipeline"):
                    raise PlanError(f"Partition rule {pattern!r} names unknown mesh axis {name!r}; "
                                     "expected 'tensor' (or None for an unsplit dimension).")
        rules.append((pattern, spec))
    return rules


def megatron_mlp_plan(shapes: Mapping[str, tuple[int, ...]], tensor: int) -> list[Rule]:
    """The default plan: alternate column- and row-parallel dense layers, in path order.

    A dense layer is a 2-D ``.../kernel`` parameter (its bias is ``.../bias``). A layer whose
    split dimension does not divide by ``tensor`` is replicated and the alternation restarts.
    """
    rules: list[Rule] = []
    column = True
    for name in sorted((n for n, s in shapes.items() if n.endswith("kernel") and len(s) == 2), key=_natural):
        prefix = name[: -len("kernel")]
        fan_in, fan_out = shapes[name]
        if column and fan_out % tensor == 0:
            rules += [("^" + re.escape(name) + "$", (None, "tensor")), ("^" + re.escape(prefix + "bias") + "$", ("tensor",))]
            column = False
        elif not column and fan_in % tensor == 0:
            rules.append(("^" + re.escape(name) + "$", ("tensor", None)))
            column = True
        else:
            column = True
    # Only rules for parameters that exist (a layer without bias).
    return [r for r in rules if any(re.search(r[0], n) for n in shapes)]


def param_specs(shapes: Mapping[str, tuple[int, ...]], plan: Any, axis_sizes: Mapping[str, int]) -> dict[str, tuple[Any, ...]]:
    """Parameter name -> partition spec tuple, checked against shapes and axis sizes.

    :param shapes: parameter path name -> shape.
    :param plan: ``None`` (the Megatron MLP default), or rules (see the module docstring).
    :param axis_sizes: mesh axis name -> size.
    :raises ValueError: a rule matching no parameter, a spec longer than the parameter's rank, or
        a split dimension that does not divide by the axis size — before anything is compiled.
    """
    tensor = axis_sizes.get("tensor", 1)
    if plan is None:
        rules = megatron_mlp_plan(shapes, tensor) if tensor > 1 else []
    else:
        rules = normalize_plan(plan)
    unmatched = [p for p, _ in rules if not any(re.search(p, n) for n in shapes)]
    if unmatched:
        listing = ", ".join(sorted(shapes, key=_natural)) or "none"
        raise PlanError(f"Partition rule(s) {unmatched} match no parameter. The model's parameters are: {listing}.")
    specs: dict[str, tuple[Any, ...]] = {}
    for name, shape in shapes.items():
        spec: tuple[Any, ...] = ()
        for pattern, rule_spec in rules:
            if re.search(pattern, name):
                spec = rule_spec
                break
        if len(spec) > len(shape):
            raise PlanError(f"Partition rule for {name!r} has {len(spec)} entries {spec} but the parameter has shape "
                             f"{shape} ({len(shape)} dimensions).")
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            size = 1
            for axis in names:
                size *= axis_sizes.get(axis, 1) if axis is not None else 1
            if shape[dim] % size:
                raise PlanError(f"Parameter {name!r} of shape {shape} cannot be split along {entry!r} (size {size}) "
                                 f"in dimension {dim}: {shape[dim]} is not a multiple of {size}. Change the rule or "
                                 "the tensor size.")
        specs[name] = spec
    return specs


def _natural(name: str) -> list[Any]:
    # "layers/10" after "layers/2": compare digit runs as numbers.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
