"""An example third-party polyparallel plugin.

It owns one type, :class:`Records` (an immutable, in-memory sequence of samples), and implements
``shard_data`` for it, registers an adapter named ``records`` and declares its capabilities
(data parallel only). polyparallel finds it through the ``polyparallel`` entry point in this
package's ``pyproject.toml``; nothing else is needed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import polyparallel as pp

__all__ = ["Records", "RecordsLoop"]
__version__ = "0.1.0"


class Records(Sequence):
    """An immutable sequence of samples that remembers which original indices it holds."""

    def __init__(self, items: Sequence[Any], indices: Sequence[int] | None = None):
        self.items = tuple(items)
        self.indices = tuple(range(len(self.items)) if indices is None else indices)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"Records({len(self)} items)"


def shard_indices(n: int, data_rank: int, data_size: int, seed: int, epoch: int,
                  shuffle: bool, remainder: str) -> list[int]:
    """This data rank's indices of ``n`` samples (strided after a seeded shuffle)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    if remainder == "drop":
        order = order[: n - n % data_size]
    elif remainder == "pad" and n % data_size:
        order += order[: data_size - n % data_size]
    return order[data_rank::data_size]


@pp.hookimpl
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    if not isinstance(data, Records):
        return None  # not ours: let another plugin answer
    picked = shard_indices(len(data), session.coords["data"], session.topology.size("data"),
                           strategy.seed, 0, policy.shuffle, policy.remainder)
    return Records([data.items[i] for i in picked], [data.indices[i] for i in picked])


class RecordsLoop:
    """What the ``records`` adapter returns: batches of this rank's shard, epoch by epoch."""

    def __init__(self, strategy: pp.Strategy, batch_size: int = 4):
        self.strategy, self.batch_size = strategy, batch_size

    def batches(self, records: Records, epoch: int = 0) -> Iterator[list[Any]]:
        session = self.strategy.session()
        picked = shard_indices(len(records), session.coords["data"], session.topology.size("data"),
                               self.strategy.seed, epoch, self.strategy.data_policy.shuffle,
                               self.strategy.data_policy.remainder)
        for start in range(0, len(picked), self.batch_size):
            yield [records.items[i] for i in picked[start:start + self.batch_size]]


@pp.hookimpl
def polyparallel_register_adapters(register: Any) -> None:
    register("records", RecordsLoop, capabilities=pp.Capabilities("records", axes={"data"}),
             description="batches of an in-memory Records collection")
