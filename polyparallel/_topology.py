"""Named-axis process topology: pure, validated, immutable data.

The layout is the one ``torch.distributed.device_mesh`` and ``jax.sharding.Mesh`` use for
``arange(world).reshape(*sizes)``: axes are ordered outermost first (``pipeline``, ``data``,
``tensor``), so tensor-parallel ranks are adjacent (Megatron's convention) and a pipeline stage
is one contiguous block of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import product
from math import prod
from typing import Any

from ._errors import TopologyError

__all__ = ["AXES", "INFER", "Topology"]

#: Known axes, outermost first. A new axis (``context``, ``expert``) is added here, at its
#: place in the nesting order; everything below iterates over this tuple.
AXES: tuple[str, ...] = ("pipeline", "data", "tensor")

#: The size that asks for an axis to be inferred from the world size.
INFER = -1

#: Rank roles (see :meth:`Topology.roles`).
ROLES: tuple[str, ...] = ("logger", "loss", "metrics", "checkpoint")


def _check_size(axis: str, value: Any) -> int:
    # bool is an int subclass; Topology(data=True) is a bug, not a size of 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(
            f"Topology axis {axis!r} must be an int (a positive size, or -1 to infer it). "
            f"Received: {axis}={value!r} of type {type(value).__name__}."
        )
    if value == 0 or value < INFER:
        raise TopologyError(
            f"Topology axis {axis!r} must be a positive size or -1 (inferred from the world "
            f"size). Received: {axis}={value}."
        )
    return value


class Topology:
    """A grid of ranks with named axes ``pipeline`` x ``data`` x ``tensor``.

    Every axis defaults to 1. At most one axis may be ``-1``: its size is inferred from the world
    size by :meth:`resolve`. Validation happens here, before any process group exists.

        >>> t = Topology(data=2, tensor=2, pipeline=2)
        >>> t.world_size, t.coords(5), t.rank_of(pipeline=1, data=0, tensor=1)
        (8, {'pipeline': 1, 'data': 0, 'tensor': 1}, 5)
        >>> t.groups("tensor")[:2]
        [[0, 1], [2, 3]]
    """

    __slots__ = ("_sizes",)

    _sizes: tuple[int, ...]

    def __init__(self, *, pipeline: int = 1, data: int = 1, tensor: int = 1, **others: int):
        if others:
            unknown = ", ".join(sorted(others))
            raise TopologyError(
                f"Unknown topology axis {unknown}. Expected axes: {', '.join(AXES)}."
            )
        given = {"pipeline": pipeline, "data": data, "tensor": tensor}
        sizes = tuple(_check_size(axis, given[axis]) for axis in AXES)
        inferred = [axis for axis, size in zip(AXES, sizes) if size == INFER]
        if len(inferred) > 1:
            raise TopologyError(
                f"At most one topology axis may be -1 (inferred); received {len(inferred)}: "
                f"{', '.join(f'{a}=-1' for a in inferred)}. Give all but one a fixed size."
            )
        object.__setattr__(self, "_sizes", sizes)

    # -- immutability and pickling ----------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Topology is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        # __slots__ descriptors would otherwise let `del topology._sizes` through.
        raise AttributeError(f"Topology is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.sizes,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and other._sizes == self._sizes

    def __hash__(self) -> int:
        return hash(("Topology", self._sizes))

    def __repr__(self) -> str:
        return "Topology(" + ", ".join(f"{a}={s}" for a, s in zip(AXES, self._sizes)) + ")"

    # -- shape -----------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        """All axes, outermost first (the dim names of the device mesh)."""
        return AXES

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size (``-1`` for an axis still to be inferred)."""
        return dict(zip(AXES, self._sizes))

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in axis order: the mesh shape."""
        self._require_resolved("shape")
        return self._sizes

    @property
    def is_resolved(self) -> bool:
        """False while an axis is ``-1``."""
        return INFER not in self._sizes

    @property
    def world_size(self) -> int:
        """Number of ranks (the product of the axis sizes)."""
        self._require_resolved("world_size")
        return prod(self._sizes)

    def size(self, axis: str) -> int:
        """Size of one axis."""
        return self._sizes[self._index(axis)]

    def parallel_axes(self) -> tuple[str, ...]:
        """The axes of size > 1 (what a plugin must support to run this topology)."""
        return tuple(a for a, s in zip(AXES, self._sizes) if s != 1)

    def resolve(self, world_size: int) -> Topology:
        """Return this topology with the ``-1`` axis inferred from ``world_size``.

        Raises :class:`TopologyError` when the fixed axes do not divide ``world_size`` or, for a
        fully given topology, when its product differs from ``world_size``.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise TopologyError(f"world size must be a positive int. Received: {world_size!r}.")
        fixed = prod(s for s in self._sizes if s != INFER)
        described = ", ".join(f"{a}={s}" for a, s in zip(AXES, self._sizes) if s != INFER)
        if self.is_resolved:
            if fixed != world_size:
                raise TopologyError(
                    f"Topology({described}) needs {fixed} ranks but the world size is "
                    f"{world_size}. Launch {fixed} processes, or set one axis to -1 to infer it."
                )
            return self
        if world_size % fixed:
            raise TopologyError(
                f"Topology({described}) does not divide world size {world_size}: the fixed axes "
                f"take {fixed} ranks and {world_size} is not a multiple of {fixed}."
            )
        sizes = tuple(world_size // fixed if s == INFER else s for s in self._sizes)
        return _rebuild(dict(zip(AXES, sizes)))

    # -- ranks and coordinates ----------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis, outermost first."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for axis, size in zip(reversed(AXES), reversed(self._sizes)):
            rank, out[axis] = divmod(rank, size)
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates. Axes left out are taken at coordinate 0."""
        self._require_resolved("rank_of")
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise TopologyError(
                f"rank_of() got unknown axis {', '.join(unknown)}. Expected axes: {', '.join(AXES)}."
            )
        rank = 0
        for axis, size in zip(AXES, self._sizes):
            c = coords.get(axis, 0)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
                raise TopologyError(
                    f"rank_of(): coordinate {axis}={c!r} is out of range for {self!r}; "
                    f"expected an int in [0, {size})."
                )
            rank = rank * size + c
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups along ``axis``: ranks that differ only in their ``axis`` coordinate.

        The groups partition all ranks; each is ordered by the ``axis`` coordinate. They are the
        groups ``DeviceMesh`` builds for the mesh dim of that name.
        """
        index = self._index(axis)
        self._require_resolved("groups")
        others = [a for i, a in enumerate(AXES) if i != index]
        result = []
        for outer in product(*[range(self._sizes[AXES.index(a)]) for a in others]):
            fixed = dict(zip(others, outer))
            result.append([self.rank_of(**fixed, **{axis: c}) for c in range(self._sizes[index])])
        return result

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks in ``rank``'s group along ``axis`` (``rank`` included)."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, axis: i}) for i in range(self.size(axis))]

    # -- roles -----------------------------------------------------------------------------
    def roles(self, rank: int) -> frozenset[str]:
        """What ``rank`` is responsible for.

        - ``loss`` and ``metrics``: ranks of the last pipeline stage (they hold the model output).
        - ``logger``: one rank, the first of the last pipeline stage (data=0, tensor=0) — not
          global rank 0, which under a pipeline is the first stage and holds no loss.
        - ``checkpoint``: ranks at data=0; each holds one distinct shard of the model (one rank
          when tensor=pipeline=1), so together they write one complete checkpoint, once.
        """
        c = self.coords(rank)
        roles = set()
        if c["pipeline"] == self.size("pipeline") - 1:
            roles |= {"loss", "metrics"}
            if c["data"] == 0 and c["tensor"] == 0:
                roles.add("logger")
        if c["data"] == 0:
            roles.add("checkpoint")
        return frozenset(roles)

    def ranks_with_role(self, role: str) -> list[int]:
        """All ranks that hold ``role`` (one of ``logger``, ``loss``, ``metrics``, ``checkpoint``)."""
        if role not in ROLES:
            raise TopologyError(f"Unknown role {role!r}. Expected one of: {', '.join(ROLES)}.")
        return [r for r in range(self.world_size) if role in self.roles(r)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: sizes, world size, groups per axis and roles per rank."""
        return {
            "axes": self.sizes,
            "world_size": self.world_size,
            "groups": {a: self.groups(a) for a in AXES},
            "ranks": [
                {"rank": r, "coords": self.coords(r), "roles": sorted(self.roles(r))}
                for r in range(self.world_size)
            ],
        }

    # -- helpers -----------------------------------------------------------------------------
    def _index(self, axis: str) -> int:
        try:
            return AXES.index(axis)
        except ValueError:
            raise TopologyError(
                f"Unknown topology axis {axis!r}. Expected one of: {', '.join(AXES)}."
            ) from None

    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise TopologyError(
                f"{self!r} has an axis of size -1; call .resolve(world_size) before {what}."
            )

    def _check_rank(self, rank: Any) -> None:
        world = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise TopologyError(
                f"rank {rank!r} is out of range for {self!r}; expected an int in [0, {world})."
            )


def _rebuild(sizes: Mapping[str, int]) -> Topology:
    return Topology(**sizes)
