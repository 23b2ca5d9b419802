"""A DeepSpeed ``mpu`` (model-parallel unit) backed by the Strategy's process groups.

DeepSpeed asks an ``mpu`` for the data-parallel group (ZeRO partitions and reduces over it) and
the model-parallel group (gradient norms and overflow checks reduce over it). Here both are the
torch runtime's DeviceMesh groups, made with the Strategy's timeout: the ``data`` axis, and the
``tensor`` axis (size 1 here: DeepSpeed's tensor slicing is not driven by the Strategy).

Only the non-pipeline engine takes an ``mpu``: ``deepspeed.initialize`` asserts ``mpu is None``
for a ``PipelineModule``, whose grid makes its own groups (see :mod:`.adapter`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TopologyMpu"]


class TopologyMpu:
    """The ``get_{data,model,tensor_model}_parallel_{group,rank,world_size}`` interface of
    Megatron's ``mpu`` over a :class:`polyparallel_torch.runtime.TorchRuntime`."""

    def __init__(self, runtime: Any):
        if runtime.mesh is None:
            raise ValueError("TopologyMpu needs the process groups of a multi-process runtime (world size > 1).")
        self.runtime = runtime
        self.topology = runtime.topology
        self.rank = runtime.rank

    def _group(self, axis: str) -> Any:
        # The mesh's own group, also for an axis of size 1 (a one-rank group: DeepSpeed reduces
        # over the model-parallel group, and None would mean the whole world).
        return self.runtime.mesh.get_group(axis)

    def __repr__(self) -> str:
        return f"<TopologyMpu rank {self.rank} of {self.topology!r}>"

    # -- data parallel: the Strategy's data axis ---------------------------------------------------------
    def get_data_parallel_group(self) -> Any:
        """The data axis's process group."""
        return self._group("data")

    def get_data_parallel_rank(self) -> int:
        """This rank's data coordinate."""
        return self.topology.coords(self.rank)["data"]

    def get_data_parallel_world_size(self) -> int:
        """The data axis size."""
        return self.topology.size("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data group."""
        return self.topology.group_of(self.rank, "data")

    # -- model parallel: the tensor axis --------------------------------------------------------------------
    def get_model_parallel_group(self) -> Any:
        """The tensor axis's process group (one rank: the adapter runs no tensor parallelism)."""
        return self._group("tensor")

    def get_model_parallel_rank(self) -> int:
        """This rank's tensor coordinate."""
        return self.topology.coords(self.rank)["tensor"]

    def get_model_parallel_world_size(self) -> int:
        """The tensor axis size."""
        return self.topology.size("tensor")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor coordinate 0 in this rank's tensor group."""
        return self.topology.group_of(self.rank, "tensor")[0]

    def get_pipe_parallel_world_size(self) -> int:
        """1: an ``mpu`` is only given to the non-pipeline engine."""
        return 1
