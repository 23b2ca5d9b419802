"""The cluster environment of the Lightning adapter: who launched the processes, ranks, world size.

Two ways to start a run, one environment class:

- **Lightning launches** (``python train.py`` with ``Trainer(devices=N)``): as Lightning's own
  ``LightningEnvironment``, ranks come from the Trainer's devices and nodes, and Lightning's
  launcher starts the other processes.
- **Something else launched** (``polyparallel launch``, torchrun, ``polyparallel.launch``, a
  scheduler that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``): :attr:`creates_processes_externally`
  is true, so Lightning does not launch again, and the global rank and world size are the
  launcher's (``RANK``, ``WORLD_SIZE``) — not recomputed from ``Trainer(devices=)``, which
  on CPU is often left at its default of 1.

``teardown`` is Lightning's when Lightning launched (it deletes the ``WORLD_SIZE`` its launcher
set), and leaves an external launcher's variables alone (as Lightning's ``TorchElasticEnvironment``
does): a later Trainer of the process sees what it would have seen without polyparallel. The
polyparallel session and its process groups outlive one ``Trainer`` anyway: they were made from
Lightning's ranks (see :mod:`polyparallel_lightning.strategy`), not from these variables.

The class is built per Lightning namespace by :func:`environment_class` (cached); the behaviour
lives in :class:`EnvironmentMixin`, which imports nothing from Lightning.
"""

from __future__ import annotations

import os

from .namespaces import per_namespace_class

__all__ = ["EnvironmentMixin", "environment_class", "launched_externally"]


def launched_externally() -> bool:
    """Whether a launcher other than Lightning's set this process's global rank and world size
    (SLURM's ``srun`` included: its ranks are set in torchrun's names first, as the session does)."""
    from polyparallel._slurm import adopt

    adopt()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class EnvironmentMixin:
    """Behaviour added on top of Lightning's ``LightningEnvironment`` (see the module docstring)."""

    @property
    def creates_processes_externally(self) -> bool:
        """True when the processes already exist: Lightning must not launch them again."""
        return "LOCAL_RANK" in os.environ or launched_externally()

    def world_size(self) -> int:
        """The launcher's ``WORLD_SIZE`` when launched externally, else what the strategy set."""
        if launched_externally():
            return int(os.environ["WORLD_SIZE"])
        return super().world_size()  # type: ignore[misc]

    def global_rank(self) -> int:
        """The launcher's ``RANK`` when launched externally, else what the strategy set."""
        if launched_externally():
            return int(os.environ["RANK"])
        return super().global_rank()  # type: ignore[misc]

    def set_global_rank(self, rank: int) -> None:
        """Record ``rank`` (Lightning computes it from devices and nodes); the launcher's ``RANK``
        wins when there is one, so ``rank_zero_only`` follows the real rank."""
        super().set_global_rank(self.global_rank() if launched_externally() else rank)  # type: ignore[misc]

    def teardown(self) -> None:
        """Lightning's teardown, unless an external launcher set the variables (module docstring)."""
        if not launched_externally():
            super().teardown()  # type: ignore[misc]


#: ``environment_class(namespace)``: the cluster-environment class for a Lightning namespace
#: (``"lightning.pytorch"`` or ``"pytorch_lightning"``), built on first use and cached.
environment_class, __getattr__ = per_namespace_class(
    "PolyparallelEnvironment", EnvironmentMixin, "{ns.fabric}.plugins.environments", "LightningEnvironment", __name__)
