"""``polyparallel.launch``: run a function in N processes through whichever runtime can."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import NoPluginError, TopologyError

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["launch"]


def launch(
    fn: Callable[..., Any],
    strategy: Strategy,
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    runtime: str | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` new processes and return the results by rank.

    Inside ``fn`` the strategy's operations work with no setup call. The topology is resolved
    against ``nprocs`` (and, with ``runtime=``, checked against that runtime's capabilities)
    *before* any process starts. A failing rank raises :class:`LaunchError` with its traceback;
    the other ranks are stopped.

    :param fn: a picklable, module-level callable.
    :param strategy: the :class:`Strategy`; it is pickled into each process.
    :param nprocs: number of processes.
    :param runtime: a runtime name (``"torch"``) whose capabilities must admit the topology.
    :param timeout: seconds after which every process is terminated and :class:`LaunchError`
        raised (a safety net for tests and scripts; collectives have the strategy's own timeout).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise TopologyError(f"launch(nprocs=) must be a positive int. Received: {nprocs!r}.")
    if not callable(fn):
        raise TypeError(f"launch() needs a callable. Received: {type(fn).__name__}.")
    strategy.topology.resolve(nprocs)  # raises a TopologyError naming sizes and nprocs
    if runtime is not None:
        strategy.check(runtime, world_size=nprocs)
    pm = strategy.plugin_manager
    results = pm.call("polyparallel_launch", fn=fn, strategy=strategy, nprocs=nprocs,
                      args=tuple(args), kwargs=dict(kwargs or {}), timeout=timeout)
    if results is None:
        raise NoPluginError(
            "No installed plugin can launch processes (none implements polyparallel_launch). "
            "Install a runtime: pip install 'polyparallel[torch]'."
        )
    return list(results)
