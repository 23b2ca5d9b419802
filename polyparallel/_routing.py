"""Which runtime runs a strategy, and the messages that say so when nothing can.

A *runtime* is what a plugin declares through ``polyparallel_capabilities`` (``torch``, ``jax``);
its :class:`~polyparallel.Capabilities` say what it needs (``imports``), which communication
backends it takes (``backends``) and how much it is preferred (``priority``). The choice for a
strategy (:func:`choose`) is made once per process and strategy value by the plugin manager and
handed to every hook as ``session.runtime``; the plugin manager calls a session's hooks only on the
plugins that serve its runtime (:meth:`~polyparallel.PluginManager.served_runtimes`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._errors import NoPluginError, TopologyError, UnsupportedTopologyError

if TYPE_CHECKING:
    from ._capabilities import Capabilities
    from ._manager import PluginManager
    from ._policies import DataPolicy
    from ._session import Session
    from ._strategy import Strategy
    from ._topology import Topology

__all__ = [
    "broken_named",
    "check_batch",
    "check_session",
    "choose",
    "data_policy_with",
    "extras",
    "install_hint",
    "no_runtime_message",
    "nobody_answered",
    "require",
    "sentences",
]

#: The runtime suggested when none is installed.
DEFAULT_EXTRA = "torch"


def extras() -> set[str]:
    """The extras of the installed polyparallel distribution (``torch``, ``lightning``, ...): what
    ``pip install 'polyparallel[name]'`` can install (empty when polyparallel is not installed)."""
    try:
        return set(importlib.metadata.metadata("polyparallel").get_all("Provides-Extra") or ())
    except importlib.metadata.PackageNotFoundError:
        return set()


def install_hint(name: str, modules: list[str] | tuple[str, ...] = ()) -> str:
    """``pip install 'polyparallel[name]'`` for a runtime or adapter the project ships, else the
    modules it needs."""
    if name in extras():
        return f"pip install 'polyparallel[{name}]'"
    if modules:
        return f"pip install {' '.join(modules)}"
    return f"install the plugin that provides {name!r} (see `polyparallel plugins`)"


def broken_named(pm: PluginManager, *names: str) -> tuple[str, str]:
    """Sentences about broken plugins: ``(about those named, about the others)``. The first names
    the broken plugins among ``names`` and says to fix their error (they are installed: an install
    hint would mislead); the second lists the other broken plugins, one of which may be wanted."""
    broken = {b.name: b for b in pm.broken()}
    named = [broken[n] for n in dict.fromkeys(names) if n in broken]
    others = [b for n, b in broken.items() if b not in named]
    first = " ".join(f"{_cap(b.describe())}; fix that error (the plugin is installed, so installing it again "
                     "will not help)." for b in named)
    rest = ("Plugins that failed to load (one may be the one you need): " + "; ".join(
        b.describe() for b in others) + ".") if others else ""
    return first, rest


def sentences(*parts: str) -> str:
    """The non-empty ``parts`` joined into one message."""
    return " ".join(p for p in parts if p)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def no_runtime_message(pm: PluginManager, needed_by: str = "") -> str:
    """Why no runtime can run anything here, and what to install."""
    runtimes = pm.runtimes()
    missing = "; ".join(f"{n} (plugin {c.plugin!r}) needs {', '.join(c.missing_imports())}"
                        for n, c in sorted(runtimes.items()) if c.missing_imports())
    what = f"{needed_by} needs a runtime, but no" if needed_by else "No"
    text = f"{what} runtime is installed" + (f" ({missing})" if missing else "") + "."
    named, others = broken_named(pm, *sorted(runtimes), DEFAULT_EXTRA)
    if named:
        return sentences(text, named, others)
    names = [DEFAULT_EXTRA, *sorted(n for n in runtimes if n != DEFAULT_EXTRA)]
    hints = " or ".join(install_hint(n, sorted(runtimes[n].imports) if n in runtimes else ()) for n in names)
    return sentences(text, f"Install one: {hints}.", others)


def _require(pm: PluginManager, name: str, runtimes: dict[str, Capabilities], asked: str) -> Capabilities:
    """The capabilities of runtime ``name``, which must be registered and installed."""
    if name not in runtimes:
        named, others = broken_named(pm, name)
        if named:
            raise NoPluginError(sentences(f"{asked} names the runtime {name!r}, but:", named, others))
        known = ", ".join(sorted(runtimes)) or "none"
        raise NoPluginError(sentences(f"{asked} names the runtime {name!r}, which no installed plugin provides. "
                                      f"Runtimes: {known}. Install it: {install_hint(name)}.", others))
    caps = runtimes[name]
    missing = caps.missing_imports()
    if missing:
        raise NoPluginError(f"{asked}: the runtime {name!r} (plugin {caps.plugin!r}) needs "
                            f"{', '.join(missing)}, which is not installed. Install it: "
                            f"{install_hint(name, missing)}.")
    return caps


def _check_backend(name: str, caps: Capabilities, backend: str | None, runtimes: dict[str, Capabilities]) -> None:
    if backend is None or backend in caps.backends:
        return
    if backend in runtimes:
        raise TopologyError(f"Strategy(backend={backend!r}) names a runtime, not a communication backend. "
                            f"Choose the runtime with Strategy(runtime={backend!r}) and leave backend=None.")
    accepted = ", ".join(map(repr, sorted(caps.backends)))
    expected = (f"it accepts {accepted}" if accepted else "it has no backend to choose, so backend must be None")
    raise TopologyError(f"Strategy(backend={backend!r}) is not a backend of the runtime {name!r} (plugin "
                        f"{caps.plugin!r}): {expected}. Use one of them, or backend=None to let the runtime choose.")


def choose(pm: PluginManager, strategy: Strategy, among: Mapping[str, str] | None = None) -> str | None:
    """The runtime for ``strategy`` (``None``: no runtime is installed and none was asked for).

    An explicit ``Strategy(runtime=)`` must be installed. Otherwise (documented in
    :meth:`polyparallel.Strategy.resolve_runtime`): the runtime chosen in the launching process
    (carried by the pickled strategy), else among the installed runtimes (narrowed by ``among``
    and by ``backend``) the only one, else the only one whose framework is already imported, else
    the highest declared priority. Never hook registration order.
    """
    runtimes = pm.runtimes()
    backend = strategy.backend
    if strategy.runtime is not None:
        name = strategy.runtime
        caps = _require(pm, name, runtimes, f"Strategy(runtime={name!r})")
        if among is not None and name not in among:
            raise UnsupportedTopologyError(_cap(_mismatch(name, among)))
        _check_backend(name, caps, backend, runtimes)
        return name
    hint = getattr(strategy, "_runtime_hint", None)
    if hint in runtimes and (among is None or hint in among) and not runtimes[hint].missing_imports():
        _check_backend(hint, runtimes[hint], backend, runtimes)
        return hint
    candidates = {n: c for n, c in runtimes.items() if among is None or n in among}
    installed = {n: c for n, c in candidates.items() if not c.missing_imports()}
    if backend is not None and installed:
        if backend in runtimes and not any(backend in c.backends for c in installed.values()):
            _check_backend(backend, runtimes[backend], backend, runtimes)  # "names a runtime": says so
        fitting = {n: c for n, c in installed.items() if backend in c.backends}
        if not fitting:
            if len(installed) == 1:
                (name, caps), = installed.items()
                _check_backend(name, caps, backend, runtimes)
            offered = "; ".join(f"{n}: {', '.join(sorted(c.backends)) or 'none (chooses itself)'}"
                                for n, c in sorted(installed.items()))
            raise TopologyError(f"Strategy(backend={backend!r}) is a backend of no installed runtime ({offered}). "
                                "Use one of those, or backend=None.")
        installed = fitting
    if not installed:
        return None
    if len(installed) == 1:
        return next(iter(installed))
    imported = [n for n, c in installed.items() if c.imported()]
    if len(imported) == 1:
        return imported[0]
    pool = imported or sorted(installed)
    top = max(installed[n].priority for n in pool)
    best = sorted(n for n in pool if installed[n].priority == top)
    if len(best) > 1:
        raise TopologyError(f"The runtimes {', '.join(map(repr, best))} are installed, "
                            f"{'imported' if imported else 'not imported'} and equally preferred (priority {top}): "
                            f"choose one with Strategy(runtime={best[0]!r}).")
    return best[0]


def _mismatch(name: str, among: Mapping[str, str]) -> str:
    needed = "; ".join(f"{who} runs on the {rt!r} runtime" for rt, who in sorted(among.items()))
    how = f"Strategy(runtime={name!r})"
    options = " or ".join(f"runtime={rt!r}" for rt in sorted(among))
    return (f"{needed}, but this strategy's runtime is {name!r} ({how}). Use Strategy({options}), or "
            "runtime=None to choose automatically.")


def require(pm: PluginManager, strategy: Strategy, among: Mapping[str, str] | None = None,
            needed_by: str = "This strategy") -> str:
    """:func:`choose`, with ``None`` (nothing installed) turned into :class:`NoPluginError`."""
    runtime = pm.resolve_runtime(strategy, among)
    if runtime is not None:
        return runtime
    if among:
        runtimes = pm.runtimes()
        names = sorted(among)
        needs = "".join(f" ({rt} needs {', '.join(runtimes[rt].missing_imports())})" for rt in names if rt in runtimes)
        named, others = broken_named(pm, *names)
        who = "; ".join(f"{w} runs on the {rt!r} runtime" for rt, w in sorted(among.items()))
        if named:
            raise NoPluginError(sentences(f"{_cap(who)}, which did not load.", named, others))
        raise NoPluginError(sentences(f"{_cap(who)}, which is not installed{needs}. Install it: "
                                      f"{' or '.join(install_hint(n) for n in names)}.", others))
    raise NoPluginError(no_runtime_message(pm, needed_by))


def check_batch(policy: DataPolicy, topology: Topology, where: str, accumulate: int = 1) -> None:
    """The global batch size must divide over the data axis of ``topology`` (when its size is
    known) times the ``accumulate`` micro-batches of a step."""
    batch = policy.batch_size
    data = topology.size("data")
    parts = data * accumulate if data >= 1 else accumulate
    if batch is None or batch % parts == 0:
        return
    lower, upper = batch // parts * parts, (batch // parts + 1) * parts
    if data >= 1:
        over = f"data={data} ranks" + (f" x accumulate={accumulate} micro-batches" if accumulate > 1 else "")
        takes = "batch_size / data" if accumulate == 1 else "batch_size / (data x accumulate)"
        what = f"each data rank takes {takes} samples a micro-step"
    else:  # the data size is not known yet: the micro-batches alone must divide it
        over, what = f"accumulate={accumulate} micro-batches", "each optimizer step is accumulate micro-batches"
    raise TopologyError(
        f"{where}: the global batch size {batch} does not divide over {over} ({what}). Use a multiple of "
        f"{parts} ({' or '.join(str(b) for b in (lower, upper) if b)}), or batch_size=None to keep a loader's own "
        "batch size per rank."
    )


def data_policy_with(policy: DataPolicy, overrides: Mapping[str, Any]) -> DataPolicy:
    """``policy`` with per-call ``shard_data`` overrides; an unknown name is refused naming the
    fields there are."""
    names = [f.name for f in dataclasses.fields(policy)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"shard_data() got unknown option(s) {', '.join(unknown)}; the options are the "
                        f"DataPolicy fields: {', '.join(names)}.")
    return dataclasses.replace(policy, **overrides)


def check_session(pm: PluginManager, session: Session) -> None:
    """Before any process group exists: the session's runtime admits its resolved topology's axes,
    and the batch size divides over its data axis (times the accumulated micro-batches; covers
    scripts under torchrun that build their Strategy themselves). Not the sharding stage nor the
    precision: an adapter may shard, or map the precision, by itself on the runtime's groups
    (DeepSpeed); they are checked by ``launch``/``check``/``adapt`` against whoever does it, and
    by the runtime's own ``wrap_model`` when it does."""
    runtime = session.runtime
    if runtime is not None:
        # Accumulation too: whoever steps, the micro-batches are the runtime's shard_data's.
        pm.runtimes()[runtime].check(session.topology, accumulate=session.strategy.accumulate)
    strategy = session.strategy
    check_batch(strategy.data_policy, session.topology, f"{strategy!r} in a world of {session.world_size}",
                strategy.grad_policy.accumulate)


def _describe(operation: str, subject: Any) -> tuple[str, str]:
    """(what the subject is, its framework's top-level module); for a mapping or a list, of its
    values (what a runtime looks at)."""
    from ._policies import Mean

    if isinstance(subject, (Mapping, list, tuple)) and subject:
        values = list(subject.values()) if isinstance(subject, Mapping) else list(subject)
        values = [v.total if isinstance(v, Mean) else v for v in values]
        kinds = ", ".join(sorted({f"{type(v).__module__}.{type(v).__qualname__}" for v in values}))
        foreign = [type(v).__module__.split(".")[0] for v in values if not isinstance(v, numbers.Real)]
        kind = type(subject)
        what = ("metrics with" if operation == "reduce_metrics" else
                f"an object of type {kind.__module__}.{kind.__qualname__} holding")
        return f"{what} values of type {kinds}", (foreign[0] if foreign else "builtins")
    kind = type(subject)
    return f"an object of type {kind.__module__}.{kind.__qualname__}", kind.__module__.split(".")[0]


def nobody_answered(pm: PluginManager, operation: str, subject: Any, session: Session | None) -> str:
    """The message of the :class:`NoPluginError` raised when no hook answered an operation."""
    described, top = _describe(operation, subject)
    runtime = getattr(session, "runtime", None)
    on = f" on the {runtime!r} runtime" if runtime else ""
    installed = ", ".join(
        f"{p.name} ({p.dist or p.module}{' ' + p.version if p.version else ''})"
        for p in pm.plugins() if p.name != "polyparallel.core"
    ) or "none"
    head = f"No polyparallel plugin handles {operation} for {described}{on}. Installed plugins: {installed}."
    runtimes = pm.runtimes()
    owner = next((n for n, c in sorted(runtimes.items()) if top in c.imports), None)
    named, others = broken_named(pm, top, *([owner] if owner else []))
    if named:
        return sentences(head, named, others)
    offered = extras()
    # Plain Python values (numbers for reduce_metrics) are any runtime's: what is missing is a runtime.
    if runtime is None and top == "builtins" and not any(not c.missing_imports() for c in runtimes.values()):
        return sentences(head, no_runtime_message(pm))
    if owner is not None and owner != runtime:
        if runtimes[owner].missing_imports():
            return sentences(head, f"{top} objects belong to the {owner!r} runtime, which is not installed: "
                                   f"{install_hint(owner)}.", others)
        return sentences(head, f"{top} objects belong to the {owner!r} runtime, but this strategy runs on "
                               f"{runtime!r}: use Strategy(runtime={owner!r}).", others)
    hint = (f"To handle {top} objects: pip install 'polyparallel[{top}]'." if top in offered and top != runtime else
            f"Install a plugin for {top} objects (extras: {', '.join(sorted(offered))}), or write one (CONTRIBUTING.md).")
    return sentences(head, hint, others)
