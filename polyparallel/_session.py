"""Per-process runtime state: kept apart from the immutable, picklable :class:`Strategy`."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._errors import TopologyError

if TYPE_CHECKING:
    from ._manager import PluginManager
    from ._strategy import Strategy
    from ._topology import Topology

__all__ = ["ProcessInfo", "Session", "SessionScope", "current_session_scope", "process_info_from_env", "session_scope"]

T = TypeVar("T")


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the launched world."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"environment variable {name} must be an int. Received: {raw!r}.") from None


def process_info_from_env() -> ProcessInfo:
    """Rank and world size from the launcher's environment (torchrun's names; 0 of 1 if unset).
    Inside a SLURM job step, SLURM's ranks are set in those names first (:func:`._slurm.adopt`)."""
    from ._slurm import adopt

    adopt()
    info = ProcessInfo(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0))
    if not 0 <= info.rank < info.world_size:
        raise TopologyError(f"RANK={info.rank} is out of range for WORLD_SIZE={info.world_size}.")
    return info


class SessionScope:
    """The sessions of one rank, where one process runs several ranks as threads.

    A session is per process per :class:`Strategy` value: that is right where every rank is a
    process (torch, torchrun, ``polyparallel.launch``). A runtime that serves several ranks from
    threads of one process (torch_xla on PJRT CPU devices: one thread per device) runs each
    replica thread inside its own scope (:func:`session_scope`): every session made there
    belongs to that scope only (its rank, its runtime objects), and closes when the scope ends.
    """

    def __init__(self, key: Hashable):
        self.key = key
        # Per plugin manager: strategy -> session, as a manager keeps its unscoped sessions.
        self.tables: dict[PluginManager, dict[Strategy, Session]] = {}
        self.closed = False

    def sessions(self) -> list[Session]:
        """The open sessions made in this scope, oldest first."""
        return [s for table in self.tables.values() for s in table.values()]

    def close(self) -> None:
        """Close every session of the scope, newest first (the first error is re-raised at the end)."""
        self.closed = True
        errors = []
        for session in reversed(self.sessions()):
            try:
                session.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"<SessionScope {self.key!r} with {len(self.sessions())} sessions>"


_SCOPE: contextvars.ContextVar[SessionScope | None] = contextvars.ContextVar("polyparallel_session_scope", default=None)


def current_session_scope() -> SessionScope | None:
    """The :class:`SessionScope` this thread runs in, or ``None`` (sessions are per process)."""
    return _SCOPE.get()


@contextlib.contextmanager
def session_scope(key: Hashable) -> Iterator[SessionScope]:
    """Run a block as one rank of a process that runs several ranks as threads: the sessions made
    inside belong to this scope (not to the process) and are closed when the block ends.

    A runtime's launcher enters it at the start of each replica thread (``key``: the rank); user
    code never needs it. Nesting is refused: a thread is one rank. The block's collectives are
    recorded in a trace of its own (:func:`polyparallel._trace.scope`: the rank's
    ``rank<r>.jsonl``, not the process's), written when the block ends.
    """
    from . import _trace

    if _SCOPE.get() is not None:
        raise RuntimeError(f"session_scope({key!r}) inside {_SCOPE.get()!r}: a thread runs one rank, "
                           "so scopes do not nest.")
    rank = key if isinstance(key, int) and not isinstance(key, bool) else None
    with _trace.scope(rank):  # outside the sessions: their closing is recorded, then the trace is written
        scope = SessionScope(key)
        token = _SCOPE.set(scope)
        failed = False
        try:
            yield scope
        except BaseException:
            failed = True
            raise
        finally:
            _SCOPE.reset(token)
            try:
                scope.close()
            except Exception:
                if not failed:  # the block's own error is the one to report
                    raise


class Session:
    """One strategy's state inside one process: rank, resolved topology, runtime objects.

    Runtime plugins keep their objects (process groups, meshes) in :meth:`stash` and release them
    with :meth:`add_finalizer`; the session is closed at interpreter exit or by :meth:`close`.
    """

    #: The runtime this session's operations run on (``Strategy.resolve_runtime``), set by the
    #: plugin manager before any hook sees the session; ``None`` when no runtime is installed.
    #: Only that runtime's plugin (and plugins that are no runtime's) see the session's hooks.
    runtime: str | None = None
    #: The :class:`SessionScope` the session was made in (``None``: the process's own session).
    scope: SessionScope | None = None

    def __init__(self, strategy: Strategy, manager: PluginManager, info: ProcessInfo):
        self.strategy = strategy
        self.manager = manager
        self.info = info
        try:
            self.topology: Topology = strategy.topology.resolve(info.world_size)
        except TopologyError as exc:
            from ._slurm import in_slurm_step

            hint = (f" (under SLURM: SLURM_NTASKS={os.environ.get('SLURM_NTASKS')} tasks were started; run as many "
                    "tasks as the strategy has ranks, e.g. `srun -n N`, or one launcher per node)"
                    if in_slurm_step() and os.environ.get("WORLD_SIZE") == os.environ.get("SLURM_NTASKS") else "")
            raise TopologyError(
                f"{strategy!r} does not fit the {info.world_size} processes launched{hint}: {exc}"
            ) from None
        self.coords: dict[str, int] = self.topology.coords(info.rank)
        self.roles: frozenset[str] = self.topology.roles(info.rank)
        self._stash: dict[Any, Any] = {}
        self._finalizers: list[Callable[[], None]] = []
        self._acquired: dict[Any, Any] = {}
        self.closed = False

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.info.world_size

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this process's group along ``axis``."""
        return self.topology.group_of(self.info.rank, axis)

    def stash(self, key: Any, factory: Callable[[], T]) -> T:
        """Return the object stored under ``key``, creating it with ``factory()`` on first use."""
        try:
            return self._stash[key]
        except KeyError:
            value = self._stash[key] = factory()
            return value

    def peek(self, key: Any, default: Any = None) -> Any:
        """The object stored under ``key`` or ``default``, without creating it."""
        return self._stash.get(key, default)

    def acquire(self, key: Any, factory: Callable[[], T], release: Callable[[T], None]) -> T:
        """A per-process resource shared by every session that asks for the same ``key``.

        Process groups belong to the process, not to one strategy: two strategies that differ only
        in a policy or a seed (``strategy.replace(seed=1)``) must use the same groups, or a rank
        that builds one of them alone would wait in group creation for peers that never come.
        The first session to ask creates the resource with ``factory()``; each session holds one
        reference until it closes, and the last reference calls ``release(resource)``.
        """
        if key in self._acquired:
            return self._acquired[key]
        value = self.manager._acquire_shared(key, factory, release)
        self._acquired[key] = value
        self.add_finalizer(lambda: self.manager._release_shared(key))
        return value

    def add_finalizer(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the session closes (last added, first called)."""
        self._finalizers.append(fn)

    def close(self) -> None:
        """Tear down: ``polyparallel_session_finish`` hooks, then finalizers. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            # Through call(): an error in a plugin's hook names the plugin, as for every hook.
            self.manager.call_for_runtime("polyparallel_session_finish", self.runtime, session=self)
        finally:
            errors = []
            while self._finalizers:
                try:
                    self._finalizers.pop()()
                except Exception as exc:  # keep tearing down the rest
                    errors.append(exc)
            self._stash.clear()
            self._acquired.clear()
            self.manager._forget_session(self)
            if errors:
                raise errors[0]

    def __repr__(self) -> str:
        return f"<Session rank={self.rank}/{self.world_size} coords={self.coords} of {self.strategy!r}>"
