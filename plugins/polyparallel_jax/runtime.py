"""The JAX runtime: a :class:`~polyparallel.Topology` as a ``jax.sharding.Mesh``.

One JAX process drives several devices (single controller), so in JAX a topology *rank* is a
device, not a process: ``Strategy(data=4, tensor=2)`` runs in one process with 8 devices, or in
2 processes with 4 devices each. The mesh uses the topology's axis names in its order
(``pipeline``, ``data``, ``tensor``) with ``AxisType.Auto`` axes, so ordinary ``jnp`` code inside
``jit`` is partitioned by GSPMD (``jax.make_mesh`` now defaults to ``Explicit`` axes, under which
a plain matmul of sharded operands is an error).

Multi-process: a process started by :mod:`polyparallel_jax.launch` finds the coordinator in
``POLYPARALLEL_JAX_COORDINATOR`` (with ``..._NUM_PROCESSES`` and ``..._PROCESS_ID``) and joins it
with ``jax.distributed.initialize`` before JAX touches a device; CPU collectives use gloo.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polyparallel as pp

if TYPE_CHECKING:
    import jax

__all__ = [
    "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "JaxRuntime",
    "as_jax_strategy", "ensure_distributed", "is_jax_strategy", "process_info", "resolve_for_devices",
    "runtime_for",
]

ENV_COORDINATOR = "POLYPARALLEL_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "POLYPARALLEL_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "POLYPARALLEL_JAX_PROCESS_ID"
#: The runtime name: ``Strategy(runtime="jax")`` runs on this plugin (ranks are devices).
RUNTIME = "jax"

_init_lock = threading.Lock()


def is_jax_strategy(strategy: pp.Strategy) -> bool:
    """Whether ``strategy`` runs on the JAX runtime in this process (its ranks are JAX devices):
    ``Strategy(runtime="jax")``, or the automatic choice (:meth:`polyparallel.Strategy.resolve_runtime`)."""
    if strategy.runtime is not None:
        return strategy.runtime == RUNTIME
    return strategy.plugin_manager.resolve_runtime(strategy) == RUNTIME


def as_jax_strategy(strategy: pp.Strategy) -> pp.Strategy:
    """``strategy`` on the JAX runtime (``runtime="jax"``), so its session counts devices.

    ``runtime=None`` becomes ``"jax"``; another runtime is refused: a JAX model cannot run on it.
    """
    if not isinstance(strategy, pp.Strategy):
        raise TypeError(f"strategy must be a polyparallel.Strategy. Received: {type(strategy).__name__}.")
    if strategy.runtime == RUNTIME:
        return strategy
    if strategy.runtime is None:
        return strategy.replace(runtime=RUNTIME)
    raise ValueError(
        f"A JAX model runs on the JAX runtime. Received: Strategy(runtime={strategy.runtime!r}). "
        "Use Strategy(runtime='jax') or runtime=None."
    )


def ensure_distributed() -> None:
    """Join the multi-process JAX world described by the environment, once (idempotent).

    Does nothing in a single process. Must run before JAX first touches a device.
    """
    address = os.environ.get(ENV_COORDINATOR)
    if not address:
        return
    import jax

    with _init_lock:
        if jax.distributed.is_initialized():
            return
        try:
            num_processes = int(os.environ[ENV_NUM_PROCESSES])
            process_id = int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError) as exc:
            raise pp.TopologyError(
                f"{ENV_COORDINATOR}={address!r} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be ints. "
                f"Received: {ENV_NUM_PROCESSES}={os.environ.get(ENV_NUM_PROCESSES)!r}, "
                f"{ENV_PROCESS_ID}={os.environ.get(ENV_PROCESS_ID)!r}."
            ) from exc
        # gloo is JAX's cross-process collective implementation for CPU devices.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=120)


def process_info() -> pp.ProcessInfo:
    """This process in device units: ``world_size`` is the global device count and ``rank`` the
    global index of this process's first device (devices are laid out process by process)."""
    ensure_distributed()
    import jax

    return pp.ProcessInfo(rank=jax.process_index() * jax.local_device_count(),
                          world_size=jax.device_count(), local_rank=jax.process_index())


def resolve_for_devices(topology: pp.Topology) -> pp.Topology:
    """``topology`` resolved against the JAX device count, with an error that says how to fix it."""
    ensure_distributed()
    import jax

    count = jax.device_count()
    try:
        return topology.resolve(count)
    except pp.TopologyError as exc:
        raise pp.TopologyError(
            f"{topology!r} does not fit the {count} JAX device(s) ({jax.process_count()} process(es) x "
            f"{jax.local_device_count()} {jax.default_backend()} device(s)): {exc} For CPU devices, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported."
        ) from None


@dataclass(frozen=True)
class JaxRuntime:
    """Per-process JAX objects for one strategy: the resolved topology and its mesh."""

    topology: pp.Topology
    mesh: Any  # jax.sharding.Mesh
    timeout: float

    @classmethod
    def build(cls, strategy: pp.Strategy) -> JaxRuntime:
        """Resolve ``strategy``'s topology against the devices and build the mesh."""
        import jax
        from jax.sharding import AxisType

        topology = resolve_for_devices(strategy.topology)
        mesh = jax.make_mesh(topology.shape, topology.axis_names,
                             axis_types=(AxisType.Auto,) * len(topology.shape), devices=jax.devices())
        return cls(topology, mesh, strategy.timeout)

    @classmethod
    def single(cls) -> JaxRuntime:
        """A one-device runtime on this process's first device (``Model.fit`` without a strategy)."""
        import jax
        from jax.sharding import AxisType

        topology = pp.Topology(data=1)
        mesh = jax.make_mesh(topology.shape, topology.axis_names, axis_types=(AxisType.Auto,) * 3,
                             devices=jax.local_devices()[:1])
        return cls(topology, mesh, 60.0)

    @property
    def data_size(self) -> int:
        """Size of the data axis."""
        return self.topology.size("data")

    def sharding(self, *spec: Any) -> jax.sharding.NamedSharding:
        """A ``NamedSharding`` on this mesh for the partition spec ``spec``."""
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(*spec))

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        """Replicated over every device."""
        return self.sharding()

    def local_data_coords(self) -> list[int]:
        """The data coordinates held by this process's devices, ascending."""
        import jax

        index = self.mesh.axis_names.index("data")
        here = jax.process_index()
        devices = self.mesh.devices
        coords = set()
        for position, device in _enumerate(devices):
            if device.process_index == here:
                coords.add(position[index])
        return sorted(coords)

    def representative_processes(self) -> list[int]:
        """One process per distinct set of data coordinates: the processes whose local metrics
        are counted once (replicas along tensor/pipeline would otherwise double count)."""
        chosen: dict[tuple[int, ...], int] = {}
        index = self.mesh.axis_names.index("data")
        per_process: dict[int, set[int]] = {}
        for position, device in _enumerate(self.mesh.devices):
            per_process.setdefault(device.process_index, set()).add(position[index])
        for process in sorted(per_process):
            chosen.setdefault(tuple(sorted(per_process[process])), process)
        covered = [c for key in chosen for c in key]
        if len(covered) != len(set(covered)):
            raise pp.TopologyError(
                f"The processes' data coordinates overlap without being equal ({per_process}); "
                "cross-process reductions need each process to hold whole data replicas."
            )
        return sorted(chosen.values())


def _enumerate(devices: Any) -> Any:
    import numpy as np

    return np.ndenumerate(devices)


def runtime_for(strategy: pp.Strategy, session: pp.Session | None = None) -> JaxRuntime:
    """The :class:`JaxRuntime` of ``strategy`` in this process, made on first use and kept in the
    session's stash (dropped when the session closes)."""
    session = session if session is not None else strategy.session()
    return session.stash(("polyparallel_jax", "runtime"), lambda: JaxRuntime.build(strategy))

