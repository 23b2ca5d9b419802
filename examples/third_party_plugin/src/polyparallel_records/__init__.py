"""An example third-party polyparallel plugin.

It owns one type, :class:`Records` (an immutable, in-memory sequence of samples), and implements
``shard_data`` for it, registers an adapter named ``records`` and declares its capabilities
(data parallel only). polyparallel finds it through the ``polyparallel`` entry point in this
package's ``pyproject.toml``; nothing else is needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import polyparallel as pp

__all__ = ["Records", "RecordsLoop"]
__version__ = "0.1.0"


class Records(Sequence):
    """An immutable sequence of samples that remembers which original indices it holds.

    What ``shard_data`` returns is this rank's shard for epoch 0; :meth:`at_epoch` gives the shard
    of any epoch (reshuffled from ``(seed, epoch)`` when the policy shuffles).
    """

    def __init__(self, items: Sequence[Any], indices: Sequence[int] | None = None):
        self.items = tuple(items)
        self.indices = tuple(range(len(self.items)) if indices is None else indices)
        self._shard: _Shard | None = None

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"Records({len(self)} items)"

    def at_epoch(self, epoch: int) -> Records:
        """This rank's shard of the original collection for ``epoch`` (only for what ``shard_data`` returned)."""
        if self._shard is None:
            raise TypeError("at_epoch() is for what strategy.shard_data(records) returned; this Records is no shard.")
        return self._shard.records(epoch)


class _Shard:
    """How a shard was cut, so that another epoch can be cut the same way."""

    def __init__(self, source: Records, data_rank: int, data_size: int, seed: int, shuffle: bool, remainder: str):
        self.source, self.data_rank, self.data_size = source, data_rank, data_size
        self.seed, self.shuffle, self.remainder = seed, shuffle, remainder

    def records(self, epoch: int) -> Records:
        # The one sharding computation every runtime uses: disjoint, complete, equal-length
        # shards as the remainder asks, reshuffled each epoch, the same on every replica.
        picked = pp.shard_indices(len(self.source), self.data_rank, self.data_size, seed=self.seed, epoch=epoch,
                                  shuffle=self.shuffle, remainder=self.remainder)
        shard = Records([self.source.items[i] for i in picked], [self.source.indices[i] for i in picked])
        shard._shard = self
        return shard


@pp.hookimpl
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    if not isinstance(data, Records):
        return None  # not ours: let another plugin answer
    # A Records is not a loader: there is no shuffle choice to inherit, so shuffle=None shuffles.
    return _Shard(data, session.coords["data"], session.topology.size("data"), strategy.seed,
                  policy.shuffles(), policy.remainder).records(0)


class RecordsLoop:
    """What the ``records`` adapter returns: batches of this rank's shard, epoch by epoch."""

    def __init__(self, strategy: pp.Strategy, batch_size: int = 4):
        self.strategy, self.batch_size = strategy, batch_size

    def batches(self, records: Records, epoch: int = 0) -> Iterator[list[Any]]:
        """This rank's batches of ``records`` in ``epoch`` (the epoch is explicit: nothing advances by itself)."""
        shard = self.strategy.shard_data(records).at_epoch(epoch)
        for start in range(0, len(shard), self.batch_size):
            yield list(shard.items[start:start + self.batch_size])


@pp.hookimpl
def polyparallel_register_adapters(register: Any) -> None:
    register("records", RecordsLoop, capabilities=pp.Capabilities("records", axes={"data"}),
             description="batches of an in-memory Records collection")
