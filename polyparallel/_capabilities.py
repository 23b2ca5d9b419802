"""What a runtime or adapter can run, declared by its plugin and checked before launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._errors import UnsupportedTopologyError
from ._topology import AXES

if TYPE_CHECKING:
    from ._topology import Topology

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """The axes and features a target (a runtime like ``"torch"`` or an adapter like
    ``"lightning"``) supports.

    :param target: the runtime or adapter name.
    :param axes: axes that may have a size > 1.
    :param features: free-form feature names (``"no_sync"``, ``"bucketing"``, ...) for listings.
    :param plugin: filled in by the plugin manager with the declaring plugin's name.
    :param excludes: sets of axes that cannot all be > 1 at once (``({"tensor", "pipeline"},)``:
        each alone is fine, both together are not).
    """

    target: str
    axes: frozenset[str] = frozenset({"data"})
    features: frozenset[str] = frozenset()
    plugin: str = ""
    excludes: tuple[frozenset[str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", frozenset(self.axes))
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(self, "excludes", tuple(frozenset(e) for e in self.excludes))
        unknown = sorted((self.axes | set().union(*self.excludes)) - set(AXES))
        if unknown:
            raise ValueError(f"Capabilities({self.target!r}) names unknown axes {unknown}; expected a subset of {AXES}.")

    def check(self, topology: Topology) -> None:
        """Raise :class:`UnsupportedTopologyError` when ``topology`` needs an axis not supported."""
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

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {"target": self.target, "axes": sorted(self.axes), "features": sorted(self.features),
                "plugin": self.plugin, "excludes": [sorted(e) for e in self.excludes]}
