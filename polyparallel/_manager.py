"""The plugin manager: lazy, idempotent entry-point loading, validated registration, and
error-translating dispatch. Runtime selection lives in :mod:`polyparallel._routing`."""

from __future__ import annotations

import atexit
import dataclasses
import difflib
import importlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import pluggy

from . import _routing, hookspecs
from ._capabilities import Capabilities
from ._errors import NoPluginError, PluginError, PolyparallelError, exception_summary
from ._session import ProcessInfo, Session, current_session_scope, process_info_from_env

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "Adapter",
    "BrokenPlugin",
    "PluginInfo",
    "PluginManager",
    "get_plugin_manager",
    "hookimpl",
]

ENTRY_POINT_GROUP = "polyparallel"
DISABLE_AUTOLOAD_ENV = "POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "POLYPARALLEL_PLUGINS"
HOOK_PREFIX = "polyparallel_"

hookimpl = pluggy.HookimplMarker("polyparallel")


class _CorePlugin:
    """The core's own defaults, registered like any plugin and overridable by all of them."""

    @hookimpl(trylast=True)
    def polyparallel_process_info(self) -> ProcessInfo:
        return process_info_from_env()


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin: its name, the distribution that shipped it, and its hooks."""

    name: str
    module: str
    dist: str | None = None
    version: str | None = None
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class BrokenPlugin:
    """An installed plugin that failed to load (its import raised, or it failed validation).

    Kept so that the error reaches the user where they use the plugin (``adapt(name)``, an
    operation nobody answered, a runtime they asked for) instead of an install hint for a
    package that is installed.
    """

    name: str
    value: str
    dist: str | None
    version: str | None
    error: str

    def describe(self) -> str:
        """``'lightning' (fake_module from polyparallel 0.1.0) failed to load: ImportError: ...``"""
        origin = f"{self.value} from {self.dist}{' ' + self.version if self.version else ''}" if self.dist else self.value
        return f"the installed plugin {self.name!r} ({origin}) failed to load: {self.error}"


@dataclass(frozen=True)
class Adapter:
    """A registered framework adapter (``Strategy.adapt(name)``)."""

    name: str
    factory: Callable[..., Any]
    capabilities: Capabilities
    plugin: str
    description: str = ""


class PluginManager:
    """Wraps a ``pluggy.PluginManager`` for the ``polyparallel`` project.

    Entry points are loaded on first use of :attr:`hook` (never at import time), once.
    ``POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD=1`` loads none of them except those named in
    ``POLYPARALLEL_PLUGINS=a,b`` (entry-point names, or importable module names). A plugin is
    validated when it is registered: a hook implementation with no spec (a misspelled
    ``polyparallel_shard_dat``) is an error naming the plugin and the hook. A broken entry point
    (its import raises, or it fails validation) is reported with a warning naming it and
    remembered (:meth:`broken`), and the others keep working.
    """

    def __init__(self, *, autoload: bool = True):
        self._pm = pluggy.PluginManager("polyparallel")
        self._pm.add_hookspecs(hookspecs)
        self._autoload = autoload
        self._loaded = False  # set once loading has *finished*: other threads wait for it
        self._loading = False  # re-entrance from the loading thread (a plugin's import) returns early
        self._lock = threading.RLock()
        self._infos: dict[str, PluginInfo] = {}
        self._broken: dict[str, BrokenPlugin] = {}
        self._adapters: dict[str, Adapter] | None = None
        self._runtimes: dict[str, Capabilities] | None = None
        #: Automatic runtime choice per strategy value (cleared when the plugins change).
        self._resolved: dict[Strategy, str | None] = {}
        self._sessions: dict[Strategy, Session] = {}
        #: Hook callers per (hook name, runtime): each holds the plugins that serve that runtime.
        self._callers: dict[tuple[str, str | None], Any] = {}
        #: Plugin name -> the runtimes whose sessions its hooks see (None: every session).
        self._served: dict[str, frozenset[str] | None] | None = None
        # Resources shared by sessions (process groups): key -> [value, references, release].
        self._shared: dict[Any, list[Any]] = {}
        self._atexit_registered = False
        self.register(_CorePlugin(), name="polyparallel.core")

    # -- loading ---------------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        """The hook relay; loads plugins on first access."""
        if not self._loaded:
            self.load()
        return self._pm.hook

    def load(self) -> None:
        """Load entry-point plugins (idempotent and thread-safe: a thread that arrives during the
        first load waits for it). A no-op for ``PluginManager(autoload=False)``."""
        with self._lock:
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                # autoload=False means "only what register() is given": neither entry points
                # nor POLYPARALLEL_PLUGINS, so unit tests are hermetic whatever the environment.
                if self._autoload:
                    self._load_entry_points()
            finally:
                self._loaded, self._loading = True, False

    def _load_entry_points(self) -> None:
        """The first load, under ``self._lock``: entry points, then ``POLYPARALLEL_PLUGINS`` modules."""
        disabled = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")
        wanted = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
        found: set[str] = set()
        for dist, ep in _entry_points():
            if disabled and ep.name not in wanted:
                continue
            found.add(ep.name)
            # A blocked plugin is not even imported (its import may be what is broken).
            if self._pm.has_plugin(ep.name) or self._pm.is_blocked(ep.name):
                continue
            dist_name = dist.metadata["Name"]
            try:
                plugin = ep.load()
                self.register(plugin, name=ep.name, dist=dist_name, version=dist.version)
            except Exception as exc:  # a broken third-party plugin must not break the rest
                broken = BrokenPlugin(ep.name, ep.value, dist_name, dist.version, exception_summary(exc, first_line=False))
                self._broken[ep.name] = broken
                warnings.warn(f"polyparallel: skipping plugin {ep.name!r} ({ep.value}) from {dist_name}: "
                              f"{broken.error}", RuntimeWarning, stacklevel=2)
        for name in wanted:
            if name in found or self._pm.has_plugin(name) or self._pm.is_blocked(name):
                continue
            try:
                self.register(importlib.import_module(name), name=name)
            except Exception as exc:
                self._broken[name] = BrokenPlugin(name, name, None, None, exception_summary(exc, first_line=False))
                warnings.warn(f"polyparallel: {PLUGINS_ENV} names {name!r}, which is neither an entry point "
                              f"nor an importable plugin module: {exception_summary(exc, first_line=False)}",
                              RuntimeWarning, stacklevel=2)

    def register(
        self, plugin: object, name: str | None = None, *, dist: str | None = None, version: str | None = None
    ) -> str | None:
        """Register a plugin object or module (hook implementations marked with ``@hookimpl``).

        :return: the name it was registered under, or ``None`` when that name is blocked
            (:meth:`set_blocked`): a blocked plugin is skipped silently.
        :raises pluggy.PluginValidationError: a hook implementation's arguments do not match its
            spec, or it implements a ``polyparallel_*`` hook that does not exist (a misspelling);
            nothing of the plugin stays registered.
        """
        with self._lock:
            registered = self._pm.register(plugin, name=name)
            if registered is None:  # blocked name (pluggy's contract): not registered
                return None
            callers = self._pm.get_hookcallers(plugin) or []
            unknown = [c.name for c in callers if not c.has_spec()
                       and not any(i.plugin is plugin and i.optionalhook for i in c.get_hookimpls())]
            if unknown:
                self._pm.unregister(plugin)
                raise pluggy.PluginValidationError(plugin, _unknown_hooks_message(registered, unknown))
            if isinstance(plugin, ModuleType):
                module = plugin.__name__
            else:  # an instance, or a class registered as it is
                module = getattr(plugin, "__module__", None) or type(plugin).__module__
            hooks = tuple(sorted(c.name for c in callers))
            self._infos[registered] = PluginInfo(registered, module, dist, version, hooks)
            self._broken.pop(registered, None)
            self._changed()
            return registered

    def unregister(self, name: str) -> None:
        """Remove a plugin by name."""
        with self._lock:
            self._pm.unregister(name=name)
            self._infos.pop(name, None)
            self._changed()

    def is_blocked(self, name: str) -> bool:
        """Whether ``name`` was blocked with :meth:`set_blocked`."""
        return self._pm.is_blocked(name)

    def set_blocked(self, name: str) -> None:
        """Block a plugin name: it is unregistered if loaded, and neither imported nor registered
        on later loads."""
        with self._lock:
            self._pm.set_blocked(name)
            self._infos.pop(name, None)
            self._broken.pop(name, None)
            self._changed()

    def _changed(self) -> None:
        # Registries, routes and automatic runtime choices are recomputed from the new set of plugins.
        self._adapters = None
        self._runtimes = None
        self._served = None
        self._callers.clear()
        self._resolved.clear()

    def plugins(self) -> list[PluginInfo]:
        """The loaded plugins, the core's own defaults first."""
        self.load()
        return list(self._infos.values())

    def broken(self) -> list[BrokenPlugin]:
        """The installed plugins that failed to load (import error, failed validation)."""
        self.load()
        return list(self._broken.values())

    # -- dispatch ------------------------------------------------------------------------------
    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a hook on every plugin; an exception from a plugin is re-raised naming the plugin."""
        caller = getattr(self.hook, hook_name)
        try:
            return caller(**kwargs)
        except Exception as exc:
            self._reraise(caller, hook_name, exc)

    def call_for_runtime(self, hook_name: str, runtime: str | None, /, **kwargs: Any) -> Any:
        """Call a hook on the plugins that serve ``runtime`` (:meth:`served_runtimes`): the plugin
        that declares that runtime, and every plugin that is no runtime's (adapters for it, data
        types of their own, wrappers). Another runtime's plugin never sees the call, so its hooks
        need no ``if session.runtime != "mine"`` guard. An exception is re-raised naming the plugin."""
        key = (hook_name, runtime)
        try:
            caller = self._callers[key]
        except KeyError:
            caller = self._callers[key] = self._routed_caller(hook_name, runtime)
        try:
            return caller(**kwargs)
        except Exception as exc:
            self._reraise(caller, hook_name, exc)

    def dispatch(self, operation: str, subject: Any, **kwargs: Any) -> Any:
        """Call the firstresult hook of an operation on the plugins that serve the session's
        runtime (:meth:`call_for_runtime`); turn "nobody answered" into an error.

        This is the hot path of every operation (< 5 us a call is the budget): the routed hook
        callers are built once per runtime and cached.
        """
        session = kwargs.get("session")
        runtime = session.runtime if session is not None else None
        result = self.call_for_runtime(f"polyparallel_{operation}", runtime, **kwargs)
        if result is None:
            raise NoPluginError(_routing.nobody_answered(self, operation, subject, session))
        return result

    def bridge(self, adapter: str, obj: Any) -> Any:
        """What the plugin that owns ``obj`` offers the adapter named ``adapter`` for it
        (``polyparallel_adapter_bridge``), or ``None``: how adapters cooperate without importing
        each other."""
        return self.call("polyparallel_adapter_bridge", adapter=adapter, obj=obj)

    def served_runtimes(self) -> dict[str, frozenset[str] | None]:
        """Plugin name -> the runtimes whose sessions (and launches) its hooks see; ``None``: all.

        A plugin that declares runtimes (``polyparallel_capabilities``) serves those, plus the
        runtimes its adapters declare; a plugin that declares no runtime serves the runtimes its
        adapters run on (``Capabilities(runtimes=)``), and every runtime when it registers no
        adapter or one that runs on any runtime. So the torch plugin never sees a JAX session, and
        the DeepSpeed adapter (``runtimes={"torch"}``) only torch sessions."""
        with self._lock:
            if self._served is None:
                declared: dict[str, set[str]] = {}
                for name, caps in self.runtimes().items():
                    declared.setdefault(caps.plugin, set()).add(name)
                served: dict[str, frozenset[str] | None] = {}
                try:
                    adapters = list(self.adapters().values())
                except PolyparallelError:
                    # A plugin failing to register its adapters is reported where adapters are used
                    # (adapt, `polyparallel plugins`); for routing its hooks see every session.
                    adapters = None
                for info in self._infos.values():
                    own = declared.get(info.name)
                    theirs = [a.capabilities.runtimes for a in adapters if a.plugin == info.name] if adapters is not None else None
                    if theirs is None:
                        served[info.name] = frozenset(own) if own else None
                    elif own:
                        served[info.name] = frozenset(own).union(*theirs)
                    elif theirs and all(theirs):
                        served[info.name] = frozenset().union(*theirs)
                    else:
                        served[info.name] = None
                self._served = served
            return dict(self._served)

    def _routed_caller(self, hook_name: str, runtime: str | None) -> Any:
        served = self.served_runtimes()
        others = [self._pm.get_plugin(name) for name, runtimes in served.items()
                  if runtimes is not None and runtime not in runtimes and self._pm.has_plugin(name)]
        # pluggy's subset caller keeps the order, the wrappers and firstresult of the remaining plugins.
        return self._pm.subset_hook_caller(hook_name, others) if others else getattr(self.hook, hook_name)

    def _reraise(self, caller: Any, hook_name: str, exc: Exception, default: str | None = None) -> NoReturn:
        plugin = _plugin_in_traceback(caller, exc.__traceback__) or default
        if plugin is None:
            raise exc
        if isinstance(exc, PolyparallelError):
            _note(exc, f"raised by plugin {plugin!r} in {hook_name}")
            raise exc
        raise PluginError(plugin, hook_name, exc) from exc

    def _per_plugin(self, hook_name: str, kwargs: Callable[[str], dict[str, Any]] | None = None
                    ) -> Iterator[tuple[str, Any]]:
        """Call a registry hook once per implementing plugin, through pluggy, so that each result
        is attributed to its plugin; other plugins' wrappers stay in every call (pluggy's
        ``subset_hook_caller``). ``kwargs(plugin name)`` gives each call's arguments. Yields
        ``(plugin name, result)`` in reverse call order."""
        caller = getattr(self.hook, hook_name)
        plain = [i for i in caller.get_hookimpls() if not (i.wrapper or i.hookwrapper)]
        for impl in plain:
            subset = self._pm.subset_hook_caller(hook_name, [i.plugin for i in plain if i is not impl])
            try:
                results = subset(**(kwargs(impl.plugin_name) if kwargs else {}))
            except Exception as exc:
                self._reraise(caller, hook_name, exc, default=impl.plugin_name)
            yield impl.plugin_name, results[0] if results else None

    # -- adapters and capabilities -------------------------------------------------------------------
    def adapters(self) -> dict[str, Adapter]:
        """Adapter name -> :class:`Adapter`, collected from ``polyparallel_register_adapters``.

        When two plugins register the same name, the one pluggy calls first wins (``tryfirst``,
        then the most recently registered), as for the firstresult operations.
        """
        with self._lock:
            if self._adapters is None:
                collected: dict[str, Adapter] = {}

                def registrar(plugin: str) -> dict[str, Any]:
                    def register(name: str, factory: Callable[..., Any], capabilities: Capabilities | None = None,
                                 description: str = "") -> None:
                        caps = capabilities or Capabilities(target=name)
                        caps = dataclasses.replace(caps, target=name, plugin=plugin)
                        collected[name] = Adapter(name, factory, caps, plugin, description)
                    return {"register": register}

                # In reverse call order: a later plugin's registration overrides an earlier one's.
                for _ in self._per_plugin("polyparallel_register_adapters", registrar):
                    pass
                # Assigned only when complete: a plugin that failed is retried, not half-cached.
                self._adapters = collected
            return dict(self._adapters)

    def runtimes(self) -> dict[str, Capabilities]:
        """Runtime name -> :class:`Capabilities`, from ``polyparallel_capabilities`` (installed or
        not: :meth:`Capabilities.missing_imports` says)."""
        with self._lock:
            if self._runtimes is None:
                result: dict[str, Capabilities] = {}
                for plugin, declared in self._per_plugin("polyparallel_capabilities"):
                    items = declared if isinstance(declared, (list, tuple)) else [declared] if declared else []
                    for caps in items:
                        if not isinstance(caps, Capabilities):
                            raise PluginError(plugin, "polyparallel_capabilities", TypeError(
                                f"expected Capabilities or a list of them; received {type(caps).__name__}"))
                        result[caps.target] = dataclasses.replace(caps, plugin=plugin)
                self._runtimes = result
            return dict(self._runtimes)

    def capabilities(self) -> dict[str, Capabilities]:
        """Target name -> :class:`Capabilities`, for runtimes and adapters (an adapter named like
        a runtime is listed under that name; :meth:`runtimes` has the runtimes alone)."""
        result = self.runtimes()
        for adapter in self.adapters().values():
            result[adapter.name] = adapter.capabilities
        return result

    def resolve_runtime(self, strategy: Strategy, among: Mapping[str, str] | None = None) -> str | None:
        """The runtime ``strategy`` runs on in this process, or ``None`` when no runtime is
        installed. See :meth:`polyparallel.Strategy.resolve_runtime` for the rules.

        :param among: restrict the choice to these runtimes (name -> who needs them, for the
            message), as an adapter's declared runtimes do; not cached.
        """
        if among is None:
            try:
                return self._resolved[strategy]
            except KeyError:
                pass
        with self._lock:
            runtime = _routing.choose(self, strategy, among)
            if among is None:
                self._resolved[strategy] = runtime
            return runtime

    # -- sessions ---------------------------------------------------------------------------------
    def session(self, strategy: Strategy) -> Session:
        """This process's :class:`Session` for ``strategy``, created on first use: the runtime
        is resolved, and the topology checked against that runtime's capabilities and the
        strategy's batch size, before any process group exists. Inside a
        :func:`~polyparallel.session_scope` (a rank run as a thread), the scope's own session."""
        scope = current_session_scope()
        table = self._sessions if scope is None else scope.tables.setdefault(self, {})
        try:
            return table[strategy]
        except KeyError:
            pass
        with self._lock:
            if strategy not in table:
                if scope is not None and scope.closed:
                    raise RuntimeError(f"{scope!r} is closed: no new session can be made in it.")
                runtime = self.resolve_runtime(strategy)
                info = self.call_for_runtime("polyparallel_process_info", runtime, strategy=strategy, runtime=runtime)
                session = Session(strategy, self, info)
                session.runtime = runtime
                session.scope = scope
                _routing.check_session(self, session)
                table[strategy] = session
                if not self._atexit_registered:
                    atexit.register(self.close_sessions)
                    self._atexit_registered = True
                try:
                    self.call_for_runtime("polyparallel_session_start", runtime, session=session)
                except BaseException as exc:
                    # Not half-started: the session is closed (the plugins that started see their
                    # finish hook, shared resources are released) and forgotten, so the next
                    # session() makes a new one and runs the start hooks again.
                    try:
                        session.close()
                    except Exception as close_exc:
                        _note(exc, f"closing the session that failed to start also failed: "
                                   f"{exception_summary(close_exc, first_line=False)}")
                    finally:
                        self._forget_session(session)
                    raise
            return table[strategy]

    def sessions(self) -> list[Session]:
        """The open sessions of this process (inside a session scope: of that scope)."""
        scope = current_session_scope()
        return list((self._sessions if scope is None else scope.tables.get(self, {})).values())

    def close_sessions(self) -> None:
        """Close every open session (runs at interpreter exit; inside a session scope, the scope's
        sessions). One session failing to close does not leave the others open; the first error
        is re-raised at the end."""
        errors = []
        for session in self.sessions():
            try:
                session.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _acquire_shared(self, key: Any, factory: Callable[[], Any], release: Callable[[Any], None]) -> Any:
        with self._lock:
            entry = self._shared.get(key)
            if entry is None:
                entry = self._shared[key] = [factory(), 0, release]
            entry[1] += 1
            return entry[0]

    def _release_shared(self, key: Any) -> None:
        with self._lock:
            entry = self._shared.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._shared[key]
        entry[2](entry[0])

    def _forget_session(self, session: Session) -> None:
        table = self._sessions if session.scope is None else session.scope.tables.get(self, {})
        if table.get(session.strategy) is session:
            del table[session.strategy]


def _unknown_hooks_message(plugin: str, unknown: list[str]) -> str:
    known = sorted(n for n in vars(hookspecs) if n.startswith(HOOK_PREFIX))
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return (f"plugin {plugin!r} implements {', '.join(parts)}, which is not a polyparallel hook. "
            f"Rename it to one of the hooks in polyparallel/hookspecs.py ({', '.join(known)}), or mark a hook "
            "of another project @hookimpl(optionalhook=True).")


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def _plugin_in_traceback(caller: Any, tb: TracebackType | None) -> str | None:
    """The plugin whose hook implementation the exception passed through (innermost)."""
    codes = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()
             if hasattr(impl.function, "__code__")}
    found = None
    while tb is not None:
        found = codes.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def _entry_points() -> Iterator[tuple[importlib.metadata.Distribution, importlib.metadata.EntryPoint]]:
    seen: set[tuple[str, str]] = set()
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and (ep.name, ep.value) not in seen:
                seen.add((ep.name, ep.value))
                yield dist, ep


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process's default plugin manager (created on first call; plugins load on first use)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = PluginManager()
    return _default
