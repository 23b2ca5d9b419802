"""The exceptions polyparallel raises. Every message says what was received and what to do."""

from __future__ import annotations

from typing import Any

__all__ = [
    "PolyparallelError",
    "TopologyError",
    "UnsupportedTopologyError",
    "NoPluginError",
    "PluginError",
    "CollectiveError",
    "CollectiveTimeout",
    "LaunchError",
    "CheckpointError",
    "exception_summary",
]


class PolyparallelError(Exception):
    """Base class of every polyparallel error."""


class TopologyError(PolyparallelError, ValueError):
    """A topology or strategy is invalid, or does not fit the world it is launched into."""


class UnsupportedTopologyError(TopologyError):
    """A plugin declared it cannot run this topology (refused before launch)."""


class NoPluginError(PolyparallelError, TypeError):
    """No installed plugin handles this object or adapter name."""


class PluginError(PolyparallelError):
    """An exception raised inside a plugin's hook, re-raised with the plugin's name."""

    def __init__(self, plugin: str, hook: str, error: BaseException):
        self.plugin, self.hook, self.error = plugin, hook, error
        super().__init__(f"plugin {plugin!r} failed in {hook}: {exception_summary(error, first_line=False)}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (launch); the default would call __init__(message).
        return (type(self), (self.plugin, self.hook, self.error), self.__dict__)


class CollectiveError(PolyparallelError, RuntimeError):
    """A collective failed. Names the operation, the axis and the rank."""

    def __init__(self, message: str, *, operation: str, axis: str, rank: int):
        self.operation, self.axis, self.rank = operation, axis, rank
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default would call __init__(message) without the keyword-only fields.
        return (_rebuild, (type(self), self.args, {"operation": self.operation, "axis": self.axis, "rank": self.rank}),
                self.__dict__)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the strategy's timeout (a peer never joined)."""


class LaunchError(PolyparallelError, RuntimeError):
    """A launched process failed; carries the failing rank and its traceback text."""

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = ""):
        self.rank, self.traceback = rank, traceback
        super().__init__(message)


class CheckpointError(PolyparallelError, ValueError):
    """A checkpoint cannot be saved or loaded as asked: not committed (half-written), truncated or
    corrupt, another model's, another runtime's, or a loader whose global batch (or data) differs
    from the saved one. Raised on every rank before any collective."""


def _rebuild(cls: type, args: tuple, kwargs: dict) -> BaseException:
    return cls(*args, **kwargs)


def exception_summary(exc: BaseException, *, first_line: bool = True) -> str:
    """``"ValueError: the first line of its message"`` (the whole message with ``first_line=False``;
    the type alone when the message is empty): how an error is named in one line of a report,
    a trace entry or a table cell."""
    text = str(exc).strip()
    if first_line:
        text = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
