"""Which Lightning: ``lightning.pytorch`` (package ``lightning``) or ``pytorch_lightning``.

The two packages ship the same code under distinct class hierarchies: a ``lightning.pytorch``
Trainer rejects a ``pytorch_lightning`` strategy and vice versa. The adapter therefore builds
its classes once per namespace, and decides which one a call wants by this rule
(:func:`resolve_namespace`):

1. ``strategy.adapt("lightning", namespace=...)`` names it (``"lightning"`` or
   ``"lightning.pytorch"``; ``"pytorch_lightning"`` or ``"pl"``);
2. otherwise the one namespace already imported (the Trainer you construct comes from it);
3. both imported: an error asking for ``namespace=`` — guessing would fail later, inside the
   Trainer, with a message that does not mention polyparallel;
4. none imported yet: the first installed of ``lightning.pytorch``, ``pytorch_lightning``.

Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Namespace", "NAMESPACES", "resolve_namespace", "per_namespace_class", "INSTALL_HINT", "LightningModuleAPI",
           "ModuleMixinBase"]

INSTALL_HINT = "pip install 'polyparallel[lightning]'"


@dataclass(frozen=True)
class Namespace:
    """One Lightning distribution: where its trainer-side and fabric-side modules live."""

    #: Module of the Trainer, LightningModule and strategies (``lightning.pytorch``).
    pytorch: str
    #: Module of the cluster environments and collectives (``lightning.fabric``).
    fabric: str
    #: What users import (``import lightning`` / ``import pytorch_lightning``); also the suffix
    #: of the per-namespace class names (a Python identifier).
    package: str


NAMESPACES: dict[str, Namespace] = {
    "lightning.pytorch": Namespace("lightning.pytorch", "lightning.fabric", "lightning"),
    "pytorch_lightning": Namespace("pytorch_lightning", "lightning_fabric", "pytorch_lightning"),
}
_ALIASES = {"lightning": "lightning.pytorch", "lightning.pytorch": "lightning.pytorch",
            "pytorch_lightning": "pytorch_lightning", "pl": "pytorch_lightning"}


def _installed(module: str) -> bool:
    # A top-level name only: find_spec of a submodule would import its parent package.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package set to None in sys.modules, or broken
        return False


def resolve_namespace(namespace: str | None = None) -> Namespace:
    """The Lightning namespace to build classes for (see the module docstring for the rule).

    :param namespace: ``None`` (automatic), ``"lightning"``/``"lightning.pytorch"`` or
        ``"pytorch_lightning"``/``"pl"``.
    :raises ValueError: an unknown name, or both namespaces imported and none named.
    :raises ImportError: the requested (or any) Lightning is not installed; names the extra.
    """
    if namespace is not None:
        if namespace not in _ALIASES:
            raise ValueError(
                f"adapt('lightning', namespace=...) must be one of {sorted(_ALIASES)}. Received: {namespace!r}."
            )
        chosen = NAMESPACES[_ALIASES[namespace]]
        if not _installed(chosen.package):
            raise ImportError(
                f"adapt('lightning', namespace={namespace!r}) needs the package {chosen.package!r}, which is not "
                f"installed. Install it: {INSTALL_HINT}."
            )
        return chosen
    imported = [ns for name, ns in NAMESPACES.items() if sys.modules.get(name) is not None]
    if len(imported) == 1:
        return imported[0]
    if len(imported) == 2:
        raise ValueError(
            "Both `lightning.pytorch` and `pytorch_lightning` are imported, and their Trainers accept only their "
            "own strategy classes. Say which Trainer you use: strategy.adapt('lightning', "
            "namespace='lightning.pytorch') for `import lightning`, or namespace='pytorch_lightning' for "
            "`import pytorch_lightning`."
        )
    for ns in NAMESPACES.values():
        if _installed(ns.package):
            return ns
    raise ImportError(
        "strategy.adapt('lightning') needs PyTorch Lightning, but neither `lightning` nor `pytorch_lightning` "
        f"can be imported. Install it: {INSTALL_HINT}."
    )


def per_namespace_class(prefix: str, mixin: type, base_path: str, base_attr: str,
                        module: str) -> tuple[Callable[[str], type], Callable[[str], Any]]:
    """A cached factory of ``mixin`` over one Lightning base class per namespace, and the module
    ``__getattr__`` that lets pickle find the classes by name.

    ``factory(namespace)`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``) imports
    ``base_path.format(ns=...)`` (e.g. ``"{ns.pytorch}.strategies"``), takes its ``base_attr`` and
    returns ``type(f"{prefix}_{ns.package}", (mixin, base), ...)`` living in ``module``, built once.
    Assign the second result to the module's ``__getattr__``: Lightning's spawn launcher pickles
    the Trainer, and unpickling looks the class up by ``module`` and name.
    """
    by_name = {f"{prefix}_{ns.package}": key for key, ns in NAMESPACES.items()}

    @functools.cache
    def factory(namespace: str) -> type:
        ns = NAMESPACES[namespace]
        base = getattr(importlib.import_module(base_path.format(ns=ns)), base_attr)
        name = f"{prefix}_{ns.package}"
        return type(name, (mixin, base), {
            "__module__": module, "__qualname__": name,
            "__doc__": f"{(mixin.__doc__ or '').rstrip()}\n\n    Over ``{base.__module__}.{base_attr}``, for the ``{ns.pytorch}`` Trainer.",
        })

    def module_getattr(name: str) -> Any:
        if name in by_name:
            return factory(by_name[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return factory, module_getattr


class LightningModuleAPI(Protocol):
    """The members of a ``LightningModule`` (either namespace's) that the module mixins of this
    plugin (the demo's and the conformance driver's) use beyond ``nn.Module``'s."""

    @property
    def current_epoch(self) -> int:
        """The Trainer's current epoch."""
        ...

    @property
    def trainer(self) -> Any:
        """The Trainer fitting this module."""
        ...

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        """Log a metric (``sync_dist=True`` reduces it through the strategy)."""
        ...


if TYPE_CHECKING:
    class ModuleMixinBase(nn.Module, LightningModuleAPI):
        """The type checker's view of a module mixin's eventual base: a LightningModule."""
else:
    # The mixins meet the real LightningModule only at run time, when a factory builds
    # ``type(name, (mixin, LightningModule), ...)`` for the namespace in use; at run time their base
    # is ``object`` so that nothing here shadows Lightning's methods (or imports torch).
    ModuleMixinBase = object
